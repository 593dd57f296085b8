"""`--service-discovery`: the router follows Kubernetes pods through the official `kubernetes` client (list,
then watch), here against a stand-in API server speaking the Kubernetes wire format (PodList JSON, watch
events as JSON lines) whose pods point at real recording workers, each on its own loopback address as
pods have their own IPs. Ready pods are registered (a prefill pod's bootstrap port from its annotation),
deleted or unready ones removed, and traffic follows."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from aiohttp import web

from tests.harness.api_server import ApiServer
from tests.harness.client import get_json, http, wait_until
from tests.harness.nodes import RouterProcess
from tests.router.conftest import ROUTER_ARGS, WORKER_SCRIPT

pytest.importorskip("kubernetes")
NS = "serving"


def pod(name, ip, role, ready=True, bootstrap_port=None):
    meta = {"name": name, "namespace": NS, "uid": name, "labels": {"app": "pdserve", "role": role}}
    if bootstrap_port is not None:
        meta["annotations"] = {"sglang.ai/bootstrap-port": str(bootstrap_port)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeApiServer(ApiServer):
    """GET /api/v1/namespaces/NS/pods: a PodList, or with watch=true the changes from then on."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.rv = 1
        self.watchers: list[tuple[str, asyncio.Queue]] = []
        self.requests: list[dict] = []
        super().__init__()

    def routes(self, app):
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self.pods_handler)

    @staticmethod
    def matches(p, selector):
        labels = p["metadata"]["labels"]
        return all(labels.get(k) == v for k, _, v in (s.partition("=") for s in selector.split(",") if s))

    async def pods_handler(self, request):
        q = request.query
        selector = q.get("labelSelector", "")
        self.requests.append(dict(q))
        if q.get("watch", "").lower() not in ("true", "1"):
            items = [p for p in self.pods.values() if self.matches(p, selector)]
            return web.json_response({"apiVersion": "v1", "kind": "PodList",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        entry = (selector, queue)
        self.watchers.append(entry)
        try:
            timeout = float(q.get("timeoutSeconds", 60))
            while True:
                event = await asyncio.wait_for(queue.get(), timeout)
                await resp.write(json.dumps(event).encode() + b"\n")
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            self.watchers.remove(entry)
        return resp

    def _change(self, kind, p):
        self.rv += 1
        p["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.pods.pop(p["metadata"]["name"], None)
        else:
            self.pods[p["metadata"]["name"]] = p
        for selector, queue in self.watchers:
            if self.matches(p, selector):
                queue.put_nowait({"type": kind, "object": p})

    def apply(self, kind, p):
        self.loop.call_soon_threadsafe(self._change, kind, p)



@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def pods_workers(tmp_path):
    """Recording workers on 127.0.0.2 (prefill), 127.0.0.3 and 127.0.0.4 (decode), all on one port."""
    from tests.harness.nodes import free_port

    port = free_port()
    procs = []
    for ip, role in (("127.0.0.2", "prefill"), ("127.0.0.3", "decode"), ("127.0.0.4", "decode")):
        procs.append(subprocess.Popen([sys.executable, str(WORKER_SCRIPT), "--host", ip, "--port", str(port),
                                       "--role", role], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        def up(ip=ip):
            try:
                return http("GET", f"http://{ip}:{port}/health", timeout=1)[0] == 200
            except OSError:
                return False
        wait_until(up, what=f"worker {ip}")
    yield port
    for p in procs:
        p.kill()
        p.wait()


def test_pods_join_and_leave_the_router(api, pods_workers, tmp_path):
    port = pods_workers
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{api.port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "u", "namespace": NS}}]}))
    api.apply("ADDED", pod("p0", "127.0.0.2", "prefill", bootstrap_port=8123))
    api.apply("ADDED", pod("d0", "127.0.0.3", "decode"))
    api.apply("ADDED", pod("d1", "127.0.0.4", "decode", ready=False))  # not ready: not a worker yet
    router = RouterProcess([], [], *ROUTER_ARGS, "--service-discovery", "--prefill-selector", "app=pdserve",
                           "role=prefill", "--decode-selector", "app=pdserve", "role=decode",
                           "--service-discovery-port", str(port), "--service-discovery-namespace", NS,
                           env={"KUBECONFIG": str(kubeconfig)}, log_path=tmp_path / "router.log")
    router.start()  # ready once a prefill and a decode pod are registered
    try:
        def workers():
            return {w["url"]: w for w in get_json(router.url + "/workers")["workers"]}

        wait_until(lambda: len(workers()) == 2, what="two pods registered")
        ws = workers()
        assert ws[f"http://127.0.0.2:{port}"]["worker_type"] == "prefill"
        assert ws[f"http://127.0.0.2:{port}"]["bootstrap_port"] == 8123  # from the annotation
        assert ws[f"http://127.0.0.3:{port}"]["worker_type"] == "decode"
        assert any(r.get("labelSelector") == "app=pdserve,role=prefill" for r in api.requests)
        status, _, body = router.post("/generate", {"text": "hi"})
        assert status == 200 and json.loads(body)["meta_info"]["worker"] == f"decode:{port}"
        # d1 turns ready, d0 is deleted: traffic moves to d1
        api.apply("MODIFIED", pod("d1", "127.0.0.4", "decode"))
        api.apply("DELETED", pod("d0", "127.0.0.3", "decode"))
        wait_until(lambda: set(workers()) == {f"http://127.0.0.2:{port}", f"http://127.0.0.4:{port}"},
                   what="d0 removed and d1 registered")
        for _ in range(3):
            assert router.post("/generate", {"text": "hi"})[0] == 200
        # a bad annotation is not trusted: the port comes from the worker's own /server_info instead
        api.apply("DELETED", pod("p0", "127.0.0.2", "prefill"))
        wait_until(lambda: f"http://127.0.0.2:{port}" not in workers(), what="p0 removed")
        api.apply("ADDED", pod("p0", "127.0.0.2", "prefill", bootstrap_port="99999; rm -rf /"))
        wait_until(lambda: f"http://127.0.0.2:{port}" in workers(), what="p0 back")
        assert workers()[f"http://127.0.0.2:{port}"]["bootstrap_port"] is None
    finally:
        router.stop()


def test_discovery_flags_are_checked():
    from router.cli import build_parser, config_from_args

    def cfg(*args):
        return config_from_args(build_parser().parse_args(["--pd-disaggregation", *args]))

    with pytest.raises(ValueError, match="needs --prefill-selector and --decode-selector"):
        cfg("--service-discovery", "--prefill-selector", "a=b")
    with pytest.raises(ValueError, match="refused without --service-discovery"):
        cfg("--prefill-selector", "a=b", "--decode-selector", "a=c")
    with pytest.raises(ValueError, match="--otlp-traces-endpoint is refused without --enable-trace"):
        cfg("--otlp-traces-endpoint", "localhost:4318")
    with pytest.raises(ValueError, match="PD-only"):
        cfg("--service-discovery", "--selector", "a=b")
    with pytest.raises(ValueError, match="key=value"):
        cfg("--service-discovery", "--prefill-selector", "ab", "--decode-selector", "a=c")
    with pytest.raises(ValueError, match="--local-prefill-queue must be >= 0"):
        cfg("--local-prefill-queue", "-1")
