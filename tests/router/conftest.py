"""Real processes on 127.0.0.1: recording workers (workers.py) and routers (`python -m router`)."""

from __future__ import annotations

import http.client as httpclient  # noqa: I001
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).resolve().parent / "workers.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, headers=None, timeout: float = 30.0):
    """One request; returns (status, headers dict (lower-case names), body bytes)."""
    host = url.split("//", 1)[1].split("/", 1)[0]
    path = "/" + url.split("//", 1)[1].split("/", 1)[1] if "/" in url.split("//", 1)[1] else "/"
    conn = httpclient.HTTPConnection(host, timeout=timeout)
    data = body if isinstance(body, bytes | type(None)) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def get_json(url: str):
    status, _, body = http("GET", url)
    assert status == 200, (url, status, body)
    return json.loads(body)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Worker:
    def __init__(self, role: str, bootstrap_port: int | None = None, record: bool = True):
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bootstrap_port = bootstrap_port
        cmd = [sys.executable, str(WORKER_SCRIPT), "--port", str(self.port), "--role", role]
        if bootstrap_port is not None:
            cmd += ["--bootstrap-port", str(bootstrap_port)]
        if not record:
            cmd.append("--no-record")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self):
        def up():
            try:
                return http("GET", self.url + "/health", timeout=1)[0] == 200
            except OSError:
                return False

        wait_until(up, what=f"{self.role} worker on {self.port}")
        return self

    def config(self, **kw):
        status, _, body = http("POST", self.url + "/debug/config", kw)
        assert status == 200, body

    def reset(self):
        http("POST", self.url + "/debug/reset", {})

    def release(self):
        http("POST", self.url + "/debug/release", {})

    def received(self) -> dict:
        return get_json(self.url + "/debug/received")

    def requests(self) -> list[dict]:
        return self.received()["requests"]

    def aborts(self) -> list[str]:
        return self.received()["aborts"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Router:
    def __init__(self, prefill: list[Worker], decode: list[Worker], *args: str, log_path: Path,
                 ports: dict[Worker, str | None] | None = None, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "router", "--pd-disaggregation", "--host", "127.0.0.1",
               "--port", str(self.port), "--prometheus-port", "0", "--worker-startup-check-interval", "0.1",
               "--retry-initial-backoff-ms", "5", "--log-level", "info"]
        for w in prefill:
            port = (ports or {}).get(w, w.bootstrap_port)
            cmd += ["--prefill", w.url] + ([] if port is None else [str(port)])
        for w in decode:
            cmd += ["--decode", w.url]
        cmd += list(args)
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()

    def wait_ready(self):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited: {self.log_path.read_text()}")
            try:
                return http("GET", self.url + "/readiness", timeout=1)[0] == 200
            except OSError:
                return False

        wait_until(ready, what="router readiness")
        return self

    def post(self, path: str, body, headers=None):
        return http("POST", self.url + path, body, headers)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def workers():
    """Two prefill workers (bootstrap ports 8998, 8999) and two decode workers, shared by all tests."""
    ws = {"p": [Worker("prefill", 8998), Worker("prefill", 8999)], "d": [Worker("decode"), Worker("decode")]}
    for w in ws["p"] + ws["d"]:
        w.wait_ready()
    yield ws
    for w in ws["p"] + ws["d"]:
        w.stop()


@pytest.fixture(autouse=True)
def _clean_workers(request):
    if "workers" in request.fixturenames:
        ws = request.getfixturevalue("workers")
        for w in ws["p"] + ws["d"]:
            w.reset()
    yield


@pytest.fixture
def make_router(tmp_path):
    routers: list[Router] = []

    def make(prefill, decode, *args, **kw):
        r = Router(prefill, decode, *args, log_path=tmp_path / f"router{len(routers)}.log", **kw)
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()
