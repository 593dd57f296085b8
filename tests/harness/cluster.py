"""What the cluster tests share: the settings of the integration suite's clusters (router + prefill
and decode nodes on 127.0.0.1, started by `Launcher.cluster`) and pool snapshots of every node.

`PDSERVE_TEST_DEVICE=cuda` puts every node of the suite on the GPU (`device_settings`): each gets
`--device cuda` and a `--mem-fraction-static` share small enough for a whole cluster and a colocated node
side by side on one GPU (bench/gpu/check.sh runs the fake-backend scenarios so). Unset, empty or "cpu",
the settings are the CPU suite's, unchanged."""

from __future__ import annotations

import os
import time

from tests.harness.client import http_json

PAGE_SIZE = 16
CHUNK = 32  # small chunks: prompts of a few dozen tokens already cross chunk boundaries

# one torch thread per node: four nodes share the machine's cores
MODEL = "tiny"  # the name the suite's nodes serve the tiny model under (a request naming another is a 404)
NODE_SETTINGS = {"page_size": PAGE_SIZE, "chunked_prefill_size": CHUNK, "max_total_tokens": 8192,
                 "max_running_requests": 64, "num_threads": 1, "log_level": "info",
                 "served_model_name": MODEL}
DEVICE_ENV = "PDSERVE_TEST_DEVICE"
# each node's share of the GPU on cuda: 2 prefill + 2 decode nodes and a colocated one take 0.6 of it together
CUDA_SHARE = 0.12


def device_settings(device: str | None) -> dict:
    """The node settings `$PDSERVE_TEST_DEVICE` adds: none for unset, empty or "cpu"; on "cuda" the device and
    each node's memory share."""
    if device in (None, "", "cpu"):
        return {}
    if device == "cuda":
        return {"device": "cuda", "mem_fraction_static": CUDA_SHARE}
    raise ValueError(f"${DEVICE_ENV}: expected cuda, cpu or nothing, got {device!r}")


NODE_SETTINGS.update(device_settings(os.environ.get(DEVICE_ENV)))
# round robin: traffic spreads over both pools deterministically; fast health checks: a killed node is
# taken out of rotation within a few seconds
ROUTER_ARGS = ["--policy", "round_robin", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "2", "--log-level", "info"]
ENV = {"PDSERVE_HEARTBEAT_INTERVAL": "0.5"}

# per-node figures that must come back to their starting values once no request is in flight
POOL_KEYS = ("kv_available_tokens", "req_slots_free", "prealloc_slots_free", "metadata_slots_free",
             "num_running_reqs", "num_waiting_reqs", "queued")


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
    return {c.name: pool_snapshot(c.url) for c in cluster.nodes if names is None or c.name in names}


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


def router_decode_of(cluster, request_id: str) -> str | None:
    """The decode URL the router logged for a request id (its one log line per request)."""
    with open(cluster.router.log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if f"rid={request_id} " in line and " decode=" in line:
                return line.split(" decode=", 1)[1].split()[0]
    return None
