"""Real processes on 127.0.0.1: recording workers (workers.py) and routers (`python -m router`), both
started as `tests.harness.nodes.ServerProcess`es."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.harness.client import get_json, http
from tests.harness.nodes import ServerProcess, start_together, stop_all

WORKER_SCRIPT = Path(__file__).resolve().parent / "workers.py"
# the router's flags of every router test: quick worker checks and retries, every request logged
ROUTER_ARGS = ["--worker-startup-check-interval", "0.1", "--retry-initial-backoff-ms",
               "5", "--log-level", "info"]


class Worker(ServerProcess):
    """A recording stand-in for a prefill or decode node (workers.py), configured at runtime."""

    def __init__(self, role: str, bootstrap_port: int | None = None, record: bool = True, **kw):
        super().__init__(f"{role}-worker", **kw)
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.record = record

    def command(self) -> list[str]:
        cmd = [sys.executable, str(WORKER_SCRIPT), "--port", str(self.port), "--role", self.role]
        if self.bootstrap_port is not None:
            cmd += ["--bootstrap-port", str(self.bootstrap_port)]
        if not self.record:
            cmd.append("--no-record")
        return cmd

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


@pytest.fixture(scope="session")
def workers(tmp_path_factory):
    """Two prefill workers (bootstrap ports 8998, 8999) and two decode workers, shared by all tests."""
    logs = tmp_path_factory.mktemp("workers")
    ws = {"p": [Worker("prefill", 8998, log_path=logs / "p0.log"),
                Worker("prefill", 8999, log_path=logs / "p1.log")],
          "d": [Worker("decode", log_path=logs / "d0.log"), Worker("decode", log_path=logs / "d1.log")]}
    start_together(ws["p"] + ws["d"])
    yield ws
    stop_all(ws["p"] + ws["d"], timeout=5)


@pytest.fixture(autouse=True)
def _clean_workers(request):
    if "workers" in request.fixturenames:
        ws = request.getfixturevalue("workers")
        for w in ws["p"] + ws["d"]:
            w.reset()
    yield


@pytest.fixture
def make_worker(launcher):
    """`make_worker(role, bootstrap_port=None, record=True)`: one more worker, started, stopped after the
    test."""

    def make(role: str, bootstrap_port: int | None = None, record: bool = True) -> Worker:
        return launcher.start(Worker(role, bootstrap_port, record,
                                     log_path=launcher.log_path(f"{role}-worker")))

    return make


@pytest.fixture
def make_router(launcher):
    """`make_router(prefill_workers, decode_workers, *router_args, ports=None, wait=True)`: a router
    (tests.harness.nodes.RouterProcess), stopped after the test."""

    def make(prefill, decode, *args, ports=None, wait=True):
        return launcher.router(prefill, decode, *ROUTER_ARGS, *args, ports=ports, wait=wait)

    return make
