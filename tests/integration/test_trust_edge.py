"""The HTTP edge of a real cluster (router + prefill + decode nodes, tiny random model, fake transfer
backend) with all three keys set: bootstrap fields checked at the router and the nodes, which key opens
which route, the router's hops with the node key (and a clear error when it is wrong), keys never in a
log, and a TLS round trip through a router to nodes that serve HTTPS."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path

import pytest

from tests.harness.client import free_port, http, http_get, http_post
from tests.harness.nodes import RoleNode, RouterCluster, RouterProcess, start_together, stop_all

KEYS = {"client": "client-key-5e2a91", "admin": "admin-key-5e2a91", "node": "node-key-5e2a91"}
AUTH = {role: {"Authorization": f"Bearer {key}"} for role, key in KEYS.items()}
NODE_SETTINGS = {"num_threads": 1, "max_total_tokens": 4096, "context_length": 256}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
BODIES = {"/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
          "/v1/completions": {"prompt": "hello", "max_tokens": 4}, "/v1/chat/completions": CHAT}
BATCHES = {"/generate": {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}},
           "/v1/completions": {"prompt": ["a", "b"], "max_tokens": 4}}
# the reviewer's values and a few more; each is a 400 naming its field, at once
BAD = [("bootstrap_room", 2**64 - 1), ("bootstrap_room", -5), ("bootstrap_room", 2**63),
       ("bootstrap_host", "a b"),
       ("bootstrap_host", "http://node"), ("bootstrap_host", "x" * 300), ("bootstrap_port", 70000),
       ("bootstrap_port", 0)]
GOOD = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}

pytestmark = pytest.mark.timeout(900)


def key_env(folder: Path, keys: dict[str, str] = KEYS) -> dict[str, str]:
    """Key files (mode 600) in `folder` for `keys` by role, and the environment that names them."""
    env = {}
    for role, var in (("client", "PDSERVE_API_KEY_FILE"), ("admin", "PDSERVE_ADMIN_API_KEY_FILE"),
                      ("node", "PDSERVE_NODE_API_KEY_FILE")):
        path = folder / f"{role}.key"
        path.write_text(keys[role] + "\n")
        path.chmod(0o600)
        env[var] = str(path)
    return env


def call(method: str, url: str, body=None, headers=None) -> tuple[int, dict | str]:
    status, _, raw = http(method, url, body, headers, timeout=60)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def error_of(status: int, body) -> str:
    assert isinstance(body, dict) and set(body["error"]) >= {"message", "type", "code"}, body
    assert body["error"]["code"] is None or isinstance(body["error"]["code"], str), body
    return body["error"]["message"]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    c = RouterCluster(tiny_model_dir, folder / "logs", prefill=1, decode=1, node_settings=NODE_SETTINGS,
                      router_args=["--policy", "round_robin"], env=key_env(folder))
    c.start()
    c.extra_logs = []
    yield c
    c.stop()


def assert_bad_bootstrap_fields(url: str, headers: dict, paths=tuple(BODIES)) -> None:
    for path in paths:
        for field, value in BAD:
            t0 = time.monotonic()
            status, body = call("POST", url + path, {**BODIES[path], **GOOD, field: value}, headers)
            assert status == 400, (path, field, value, body)
            assert f"`$.{field}`" in error_of(status, body) or f"`{field}`" in error_of(status, body), body
            assert time.monotonic() - t0 < 10
    for path in BATCHES:
        good = {k: [v, v] for k, v in GOOD.items()}
        good["bootstrap_room"] = [7, 8]
        for field, value in BAD:
            body_in = {**BATCHES[path], **good, field: [good[field][0], value]}
            status, body = call("POST", url + path, body_in, headers)
            assert status == 400, (path, field, value, body)
            msg = error_of(status, body)
            assert f"`$.{field}[1]`" in msg or f"`{field}[1]`" in msg, msg


def chat_ok(url: str, headers: dict) -> None:
    status, body = call("POST", url + "/v1/chat/completions", CHAT, headers)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"], body


# ---------------------------------------------------------------------------------------------- the router
def test_router_public_routes_take_the_client_key_only(keyed):
    chat_ok(keyed.url, AUTH["client"])
    for headers in ({}, AUTH["admin"], AUTH["node"], {"Authorization": "Bearer nope"}):
        status, body = call("POST", keyed.url + "/v1/chat/completions", CHAT, headers)
        msg = error_of(status, body)
        assert status == 401 and "key" in msg.lower(), body
        assert all(k not in msg for k in KEYS.values()) and "admin" not in msg and "node" not in msg
    for path in ("/health", "/liveness", "/readiness", "/metrics", "/openapi.json"):
        assert http_get(keyed.url + path)[0] == 200, path


def test_router_rejects_bad_bootstrap_fields_and_overwrites_good_ones(keyed):
    assert_bad_bootstrap_fields(keyed.url, AUTH["client"])
    # a client's valid rendezvous is replaced by the router's own (as sglang-router does)
    status, body = call("POST", keyed.url + "/v1/chat/completions",
                        {**CHAT, "bootstrap_host": "203.0.113.9", "bootstrap_port": 1, "bootstrap_room": 1},
                        AUTH["client"])
    assert status == 200, body
    chat_ok(keyed.url, AUTH["client"])


def test_router_admin_routes_need_the_admin_key(keyed):
    decode = keyed.decodes[0]
    for headers in ({}, AUTH["client"], AUTH["node"]):
        assert call("GET", keyed.url + "/workers", None, headers)[0] == 401
        assert call("POST", keyed.url + "/workers", {"url": decode.url,
                                                     "worker_type": "decode"}, headers)[0] == 401
        assert call("DELETE", keyed.url + "/workers/" + decode.url, None, headers)[0] == 401
        assert call("POST", keyed.url + "/flush_cache", {}, headers)[0] == 401
    status, body = call("GET", keyed.url + "/workers", None, AUTH["admin"])
    assert status == 200 and body["total"] == 2, body
    assert call("POST", keyed.url + "/workers", {"url": decode.url,
                                                 "worker_type": "decode"}, AUTH["admin"])[0] == 409
    assert call("DELETE", keyed.url + "/workers/" + decode.url, None, AUTH["admin"])[0] == 200
    # no decode worker
    assert call("POST", keyed.url + "/v1/chat/completions", CHAT, AUTH["client"])[0] == 503
    status, body = call("POST", keyed.url + "/workers",
                        {"url": decode.url, "worker_type": "decode"}, AUTH["admin"])
    assert status == 200, body
    chat_ok(keyed.url, AUTH["client"])
    assert call("POST", keyed.url + "/flush_cache", {}, AUTH["admin"])[0] == 200  # fans out with the node key


# ---------------------------------------------------------------------------------------------- the nodes
def test_nodes_reject_bad_bootstrap_fields_and_keep_serving(keyed):
    for node in keyed.nodes:
        assert_bad_bootstrap_fields(node.url, AUTH["node"])
        assert_bad_bootstrap_fields(node.url, AUTH["client"], paths=("/v1/completions",))
    chat_ok(keyed.url, AUTH["client"])


def test_node_routes_by_key(keyed):
    node = keyed.prefills[0]
    # public routes: the client key or the node key
    for role, expect in (("client", 200), ("node", 200), ("admin", 401)):
        assert call("GET", node.url + "/v1/models", None, AUTH[role])[0] == expect, role
    assert call("GET", node.url + "/v1/models")[0] == 401
    assert call("POST", node.url + "/abort_request", {"rid": "no-such-rid"}, AUTH["client"])[0] == 200
    # admin routes: the admin key or the node key, never the client key
    for path, body in (("/flush_cache", {}), ("/abort_request", {"abort_all": True})):
        for headers in ({}, AUTH["client"], {"Authorization": "Bearer nope"}):
            status, answer = call("POST", node.url + path, body, headers)
            assert status == 401, (path, headers, answer)
            assert all(k not in error_of(status, answer) for k in KEYS.values())
        for role in ("admin", "node"):
            status, answer = call("POST", node.url + path, body, AUTH[role])
            assert status == 200, (path, role, answer)
    for path in ("/health", "/health_generate", "/metrics", "/openapi.json"):
        assert http_get(node.url + path)[0] == 200, path
    status, raw = http_get(node.url + "/server_info", headers=AUTH["client"])
    assert status == 200 and not any(k in raw.decode() for k in KEYS.values())
    status, raw = http_get(node.url + "/metrics")
    assert not any(k in raw.decode() for k in KEYS.values())


def test_wrong_node_key_is_a_clear_error(keyed, tmp_path):
    env = {"PDSERVE_NODE_API_KEY": "not-the-node-key"}
    router = RouterProcess(keyed.prefills, keyed.decodes, "--policy", "round_robin",
                           "--api-key", "argv-key-5e2a91",
                           "--retry-initial-backoff-ms", "1", env=env, log_path=tmp_path / "wrong-router.log")
    keyed.extra_logs.append(router.log_path)
    try:
        router.start()  # /health is open: the workers register
        status, body = call("POST", router.url + "/v1/chat/completions", CHAT,
                            {"Authorization": "Bearer argv-key-5e2a91"})
        msg = error_of(status, body)
        assert status == 502 and "node key" in msg and "refused" in msg, body
    finally:
        router.stop()
    log = router.log_text()
    assert "refused the router's credentials" in log and "`ps`" in log  # the --api-key warning
    assert "argv-key-5e2a91" not in log and "not-the-node-key" not in log
    assert "status=401" in keyed.prefills[0].log_text() + keyed.decodes[0].log_text()
    chat_ok(keyed.url, AUTH["client"])


def test_keys_never_in_logs(keyed):
    """Last in the module: every log the keyed processes wrote so far."""
    own = "\n".join(Path(c.log_path).read_text(errors="replace") for c in keyed.children)
    assert "no admin key" not in own  # every process of the cluster has one
    text = own + "\n".join(Path(p).read_text(errors="replace") for p in keyed.extra_logs)
    for role, key in KEYS.items():
        assert key not in text, f"the {role} key is in a log"
    assert "Keys(client=set, admin=set, node=set)" in text


# ---------------------------------------------------------------------------------------------- TLS
def _ctx(cafile: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cafile)


def _https_ready(url: str, cafile: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=_ctx(cafile)) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class TLSNode(RoleNode):
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def is_ready(self) -> bool:
        return _https_ready(self.url + "/health", self.settings["ssl_certfile"])


class TLSRouter(RouterProcess):
    cafile = ""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def is_ready(self) -> bool:
        return _https_ready(self.url + "/readiness", self.cafile)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (openssl CLI), used as its own CA."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_round_trip_through_the_router(tiny_model_dir, certificate, tmp_path):
    cert, key = certificate
    tls = {"ssl_certfile": cert, "ssl_keyfile": key, "transfer_backend": "fake", **NODE_SETTINGS}
    prefill = TLSNode("prefill", tiny_model_dir, log_path=tmp_path / "prefill.log",
                      disaggregation_bootstrap_port=free_port(), **tls)
    decode = TLSNode("decode", tiny_model_dir, log_path=tmp_path / "decode.log", **tls)
    router = TLSRouter([prefill], [decode], "--ssl-certfile", cert, "--ssl-keyfile",
                       key, "--ssl-ca-certs", cert,
                       "--policy", "round_robin", log_path=tmp_path / "router.log")
    router.cafile = cert
    try:
        start_together([prefill, decode])
        router.start()
        req = urllib.request.Request(router.url + "/v1/chat/completions", data=json.dumps(CHAT).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120, context=_ctx(cert)) as r:
            body = json.loads(r.read())
        assert body["choices"][0]["message"]["content"], body
        with urllib.request.urlopen(router.url + "/workers", timeout=30, context=_ctx(cert)) as r:
            workers = json.loads(r.read())["workers"]  # loopback client, no admin key: allowed
        assert {w["url"] for w in workers} == {prefill.url, decode.url} \
            and all(w["is_healthy"] for w in workers)
        with pytest.raises((OSError, HTTPException)):  # no plain HTTP on a TLS port
            http_post(f"http://127.0.0.1:{router.port}/v1/chat/completions", CHAT, timeout=10)
    finally:
        stop_all([router, prefill, decode])
    assert "serving on https://" in prefill.log_text() and "router listening on https://" in router.log_text()
