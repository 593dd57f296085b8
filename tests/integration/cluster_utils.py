"""Helpers of the integration suite: HTTP calls, SSE reading, pool snapshots of every node."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from deploy.cluster import Cluster

PAGE_SIZE = 16
CHUNK = 32  # small chunks: prompts of a few dozen tokens already cross chunk boundaries

# one torch thread per node: four nodes share the machine's cores
NODE_ARGS = ["--page-size", str(PAGE_SIZE), "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "8192",
             "--max-running-requests", "64", "--num-threads", "1", "--log-level", "info"]
# round robin: traffic spreads over both pools deterministically; fast health checks: a killed node is
# taken out of rotation within a few seconds
ROUTER_ARGS = ["--policy", "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--log-level", "info"]


def make_cluster(model_dir: str, log_dir: Path, *, backend: str = "fake", prefill: int = 2, decode: int = 2,
                 router_args: list[str] | None = None, role_env: dict | None = None,
                 env: dict | None = None) -> Cluster:
    return Cluster(num_prefill=prefill, num_decode=decode, model=model_dir, transfer_backend=backend,
                   log_dir=str(log_dir), node_args=list(NODE_ARGS),
                   router_args=list(ROUTER_ARGS) + list(router_args or []), role_env=role_env or {},
                   env={"PDSERVE_HEARTBEAT_INTERVAL": "0.5", **(env or {})}, startup_timeout=300,
                   grace_period=15, quiet=True)


# per-node figures that must come back to their starting values once no request is in flight
POOL_KEYS = ("kv_available_tokens", "req_slots_free", "prealloc_slots_free", "metadata_slots_free",
             "num_running_reqs", "num_waiting_reqs", "queued")


def http_json(method: str, url: str, body=None, headers: dict | None = None,
              timeout: float = 120.0) -> tuple[int, object]:
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def error_message(body) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return str(body)


@dataclass
class StreamResult:
    status: int
    events: list = field(default_factory=list)  # parsed JSON events
    done: bool = False  # saw data: [DONE]
    error: str = ""  # an error event, a non-200 body, or a broken connection
    request_id: str = ""
    stopped: bool = False  # the client closed the connection on purpose

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error


def stream(url: str, body: dict, *, request_id: str = "", timeout: float = 180.0, on_event=None,
           stop_after: int | None = None, stop_when=None) -> StreamResult:
    """POST a streaming request and read its SSE events. `on_event(i, event)` is called for each;
    `stop_after=N` closes the connection after N events, `stop_when(i)` when it returns true (a client
    that goes away: `stopped` is set)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-ID"] = request_id
    res = StreamResult(status=0, request_id=request_id)
    try:
        conn.request("POST", u.path, json.dumps(body), headers)
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read().decode(errors="replace")
            return res
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                res.done = True
                break
            event = json.loads(payload)
            if isinstance(event, dict) and "error" in event:
                res.error = error_message(event)
            res.events.append(event)
            if on_event is not None:
                on_event(len(res.events), event)
            if (stop_after is not None and len(res.events) >= stop_after) or \
                    (stop_when is not None and stop_when(len(res.events))):
                res.stopped = True
                return res
    except (OSError, http.client.HTTPException) as e:
        res.error = res.error or f"connection: {type(e).__name__}: {e}"
    finally:
        conn.close()
    if res.status == 200 and not res.done and not res.error:
        res.error = "stream ended without [DONE]"
    return res


def node_stats(url: str) -> dict:
    status, info = http_json("GET", url + "/server_info", timeout=10)
    assert status == 200, f"{url}/server_info: {status} {info}"
    return info["stats"]


def pool_snapshot(url: str) -> dict:
    s = node_stats(url)
    queues = s.get("num_queue_reqs") or {}
    return {
        "kv_available_tokens": s["kv_free_tokens"] + s.get("kv_evictable_tokens", 0),
        "req_slots_free": s["req_slots_free"],
        "prealloc_slots_free": s.get("prealloc_slots_free"),
        "metadata_slots_free": s.get("metadata_slots_free"),
        "num_running_reqs": s["num_running_reqs"],
        "num_waiting_reqs": s["num_waiting_reqs"],
        "queued": sum(queues.values()) if isinstance(queues, dict) else queues,
    }


def cluster_pools(cluster, names: list[str] | None = None) -> dict[str, dict]:
    nodes = [c for c in cluster.children if c.role != "router" and (names is None or c.name in names)]
    return {c.name: pool_snapshot(c.url) for c in nodes}


def wait_pools(cluster, baseline: dict[str, dict], timeout: float = 90.0) -> dict[str, dict]:
    """Wait until every node in `baseline` that is still alive is back at its baseline figures;
    fail naming the node and the figures that differ."""
    alive = [n for n in baseline if cluster.child(n).alive()]
    deadline = time.time() + timeout
    while True:
        now = cluster_pools(cluster, alive)
        diff = {n: {k: (baseline[n][k], now[n][k]) for k in POOL_KEYS if now[n][k] != baseline[n][k]}
                for n in alive}
        diff = {n: d for n, d in diff.items() if d}
        if not diff:
            return now
        if time.time() > deadline:
            raise AssertionError(f"pools not back at their starting figures after {timeout:.0f}s "
                                 f"(node: {{figure: (start, now)}}): {diff}")
        time.sleep(0.25)


def metric_total(url: str, name: str) -> float:
    """Sum of a Prometheus counter's samples at url/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def router_decode_of(cluster, request_id: str) -> str | None:
    """The decode URL the router logged for a request id (its one log line per request)."""
    with open(cluster.router.log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if f"rid={request_id} " in line and " decode=" in line:
                return line.split(" decode=", 1)[1].split()[0]
    return None
