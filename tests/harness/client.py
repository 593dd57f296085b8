"""The client side of the tests: free ports, HTTP calls, SSE reading, Prometheus counters, polling.

* `free_port()`: a free port below the ephemeral range that no other server of this test run was given
  (deploy/procs.py; each pytest-xdist worker draws from its own share)

* `http(method, url, body, headers, timeout) -> (status, headers with lower-case names, body bytes)`
* `http_get(url) / http_post(url, body) -> (status, body bytes)`; an HTTP error is a status, not an exception
* `http_json(method, url, body) -> (status, parsed JSON or the text)`; `get_json(url)` asserts 200
* `stream(url, body, ...) -> StreamResult`: a streaming POST read event by event
* `wait_until(predicate, timeout, what)`: poll until true, fail naming `what`
"""

from __future__ import annotations

import http.client as httpclient  # `http` is the request helper below
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

from deploy.procs import free_port as free_port  # the ports of every server the suite starts, clusters too
from deploy.procs import set_port_share


def _share_ports_with_other_workers() -> None:
    """Each pytest-xdist worker (gw0, gw1, ...) takes the ports of its own parity: two servers of one run
    never draw the same port. (Two nodes of a cluster once did: the one that lost the bind looked ready,
    as its /health check reached the other.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        set_port_share(int(worker[2:]), count)


_share_ports_with_other_workers()


def http(method: str, url: str, body=None, headers=None, timeout: float = 30.0):
    """One request; returns (status, headers dict (lower-case names), body bytes)."""
    u = urlparse(url)
    conn = httpclient.HTTPConnection(u.netloc, timeout=timeout)
    data = body if isinstance(body, bytes | type(None)) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    path = u.path or "/"
    conn.request(method, path + (f"?{u.query}" if u.query else ""), body=data, headers=h)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def get_json(url: str):
    status, _, body = http("GET", url)
    assert status == 200, (url, status, body)
    return json.loads(body)


def _urlopen(req: urllib.request.Request, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_get(url: str, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    return _urlopen(urllib.request.Request(url, headers=headers or {}), timeout)


def http_post(url: str, body: bytes | dict | list | str, headers: dict | None = None,
              timeout: float = 120.0) -> tuple[int, bytes]:
    if isinstance(body, dict | list):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    return _urlopen(urllib.request.Request(url, data=body, headers=h, method="POST"), timeout)


def http_json(method: str, url: str, body=None, headers: dict | None = None,
              timeout: float = 120.0) -> tuple[int, object]:
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    status, raw = _urlopen(req, timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def error_message(body) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return str(body)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.02):
    """Poll `predicate` until it returns something true (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


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
    conn = httpclient.HTTPConnection(u.hostname, u.port, timeout=timeout)
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
    except (OSError, httpclient.HTTPException) as e:
        res.error = res.error or f"connection: {type(e).__name__}: {e}"
    finally:
        conn.close()
    if res.status == 200 and not res.done and not res.error:
        res.error = "stream ended without [DONE]"
    return res


def metric_total(url: str, name: str) -> float:
    """Sum of a Prometheus counter's samples at url/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
