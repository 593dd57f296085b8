"""The trust rules on their own, without processes: the bootstrap field rule (common/protocol.py), key
sources and checks (common/server/security.py), the router's worker URLs and its admin/loopback rule."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from unittest import mock

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from common.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    decode_json,
    normalize_host,
    normalize_hosts,
)
from common.server.security import (
    ADMIN,
    OPEN,
    PUBLIC,
    Denied,
    Keys,
    KeySourceError,
    bearer_token,
    check_access,
    is_loopback,
    key_matches,
    load_key,
)


# --------------------------------------------------------------------------------------------- bootstrap rule
@pytest.mark.parametrize("host,expect", [
    ("localhost", "localhost"), ("127.0.0.1", "127.0.0.1"),
    ("node-1.pd.svc.cluster.local", "node-1.pd.svc.cluster.local"),
    ("::1", "[::1]"), ("[::1]", "[::1]"), ("[2001:db8::0:1]", "[2001:db8::1]"), ("a" * 63, "a" * 63),
])
def test_valid_hosts_normalized(host, expect):
    assert normalize_host(host) == expect


@pytest.mark.parametrize("host", [
    "a b", "", "http://node", "node:8998", "node/route", "999.1.1.1", "1.2.3", "-node", "node-", "my_node",
    "[127.0.0.1]", "a" * 64, ".".join(["a" * 60] * 5), "nøde", "node\n", "[::1", "::1]",
])
def test_invalid_hosts_named(host):
    with pytest.raises(BadRequest, match=r"`bootstrap_host`"):
        normalize_host(host)


def test_per_item_hosts_name_the_index():
    assert normalize_hosts(["a", "::1"]) == ["a", "[::1]"]
    with pytest.raises(BadRequest, match=r"`bootstrap_host\[1\]`"):
        normalize_hosts(["a", "a b"])
    assert normalize_hosts(None) is None


@pytest.mark.parametrize("type_", [GenerateRequest, CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("field,value", [
    ("bootstrap_room", 2**64 - 1), ("bootstrap_room", -5), ("bootstrap_room", 2**63),
    ("bootstrap_port", 70000),
    ("bootstrap_port", 0), ("bootstrap_port", -1), ("bootstrap_port", True), ("bootstrap_host", "x" * 300),
])
def test_ranges_checked_at_decode(type_, field, value):
    body = {{GenerateRequest: "text", CompletionRequest: "prompt"}.get(type_, "messages"): "hi", field: value}
    if type_ is ChatCompletionRequest:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match=rf"`\$\.{field}`"):
        decode_json(json.dumps(body).encode(), type_)


def test_per_item_ranges_name_the_index():
    body = {"text": ["a", "b"], "bootstrap_room": [1, 2**64 - 1], "bootstrap_port": [1, 1],
            "bootstrap_host": ["a", "a"]}
    with pytest.raises(BadRequest, match=r"`\$\.bootstrap_room\[1\]`"):
        decode_json(json.dumps(body).encode(), GenerateRequest)
    ok = decode_json(json.dumps({**body, "bootstrap_room": [0, 2**63 - 1]}).encode(), GenerateRequest)
    assert ok.bootstrap_room == [0, 2**63 - 1]


def test_body_type_errors_name_the_body():
    with pytest.raises(BadRequest, match=r"request body.*`\$`"):
        decode_json(b"[1, 2]", GenerateRequest)


# ---------------------------------------------------------------------------------------------- key sources
def _file(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> str:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
    return str(p)


def test_key_sources_and_precedence(tmp_path):
    env = {"PDSERVE_API_KEY": "from-env", "PDSERVE_ADMIN_API_KEY_FILE": _file(tmp_path, "a", "admin-key\n")}
    assert load_key("client", env=env) == b"from-env"
    assert load_key("admin", env=env) == b"admin-key"  # trailing newline stripped
    assert load_key("node", env=env) is None
    assert load_key("client", path=_file(tmp_path, "c", "from-file"), env=env) == b"from-file"
    assert load_key("client", value="from-flag", env=env) == b"from-flag"
    with pytest.raises(KeySourceError, match="not both"):
        load_key("client", env={"PDSERVE_API_KEY": "x", "PDSERVE_API_KEY_FILE": "/nope"})
    with pytest.raises(KeySourceError, match="not both"):
        load_key("client", path="/nope", value="x", env={})


@pytest.mark.parametrize("text,why", [("", "empty"), ("two words", "printable"), ("tab\there", "printable")])
def test_bad_key_files_never_echo_the_key(tmp_path, text, why):
    path = _file(tmp_path, "k", text)
    with pytest.raises(KeySourceError, match=why) as e:
        load_key("node", path=path, env={})
    assert path in str(e.value) and (not text.strip() or text not in str(e.value))
    with pytest.raises(KeySourceError, match="cannot read"):
        load_key("node", path=str(tmp_path / "missing"), env={})


def test_readable_key_file_warns_once(tmp_path, caplog):
    path = _file(tmp_path, "loose", "secret-value-1", 0o644)
    with caplog.at_level(logging.WARNING):
        load_key("admin", path=path, env={})
        load_key("admin", path=path, env={})
    warnings = [r.getMessage() for r in caplog.records if "chmod 600" in r.getMessage()]
    assert len(warnings) == 1 and "secret-value-1" not in caplog.text


def test_keys_repr_and_api_key_warning(caplog):
    with caplog.at_level(logging.WARNING):
        keys = Keys.load(api_key="visible-in-ps", env={"PDSERVE_NODE_API_KEY": "node-secret"})
    assert repr(keys) == "Keys(client=set, admin=unset, node=set)"
    assert "`ps`" in caplog.text and "visible-in-ps" not in caplog.text
    assert keys.outgoing() == b"node-secret"
    assert Keys(client=b"c").outgoing() == b"c"


# ---------------------------------------------------------------------------------------------- checks
def test_bearer_and_constant_time_match():
    assert bearer_token({"Authorization": "Bearer abc"}) == b"abc"
    assert bearer_token({"Authorization": "bearer  abc "}) == b"abc"
    assert bearer_token({"Authorization": "Basic abc"}) is None and bearer_token({}) is None
    assert key_matches(b"abc", b"abc") and not key_matches(b"abc", b"abcd") and not key_matches(None, b"x")


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.3") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback("") and not is_loopback(None)
    assert not is_loopback("fe80::1%eth0") and not is_loopback("junk")


C, A, N = b"client-k", b"admin-k", b"node-k"


def _status(access, token, remote="127.0.0.1", keys=None, node=True):
    try:
        check_access(access, "/x", token, remote, keys or Keys(C, A, N), accept_node_key=node)
    except Denied as e:
        assert e.message and all(k.decode() not in e.message for k in (C, A, N))
        assert "admin key" not in e.message and "node key" not in e.message and "client key" not in e.message
        return e.status
    return 200


def test_access_matrix():
    remote = "10.1.2.3"
    # open routes: anyone
    assert _status(OPEN, None, remote) == 200
    # public: client or node key
    assert [_status(PUBLIC, t, remote) for t in (None, b"bad", C, A, N)] == [401, 401, 200, 401, 200]
    # admin: admin or node key, never the client key
    assert [_status(ADMIN, t, remote) for t in (None, b"bad", C, A, N)] == [401, 401, 401, 200, 200]
    # the router accepts no node key from its callers
    assert _status(PUBLIC, N, remote, node=False) == 401 and _status(ADMIN, N, remote, node=False) == 401
    # no keys at all: public open, admin loopback-only
    none = Keys()
    assert _status(PUBLIC, None, remote, none) == 200
    assert _status(ADMIN, None, "127.0.0.1", none) == 200 and _status(ADMIN, None, remote, none) == 403
    # no admin key but a client key: admin from loopback with the client key only
    client_only = Keys(client=C)
    assert _status(ADMIN, C, "127.0.0.1", client_only) == 200 \
        and _status(ADMIN, None, "127.0.0.1", client_only) == 401
    assert _status(ADMIN, C, remote, client_only) == 403
    # only a node key: the node's public routes need it too (clients go through the router)
    assert _status(PUBLIC, None, remote, Keys(node=N)) == 401 \
        and _status(ADMIN, N, remote, Keys(node=N)) == 200


# ---------------------------------------------------------------------------------------------- router
def test_worker_urls_follow_the_host_rule():
    from router.registry import check_worker_url

    for url in ("http://127.0.0.1:30001", "https://node-1.local", "http://[::1]:8000"):
        assert check_worker_url(url) == url
    for url in ("ftp://x", "http://a b:1", "http://x:70000", "http://u:p@x", "http://x/path", "http://x?q=1",
                "http://my_node:1", "http://", "127.0.0.1:30001"):
        with pytest.raises(ValueError, match="`url`"):
            check_worker_url(url)


def _router_app(**cfg):
    from router.app import RouterApp
    from router.config import RouterConfig

    return RouterApp(RouterConfig(**cfg), session=None)


async def _through_middleware(ra, method, path, remote, headers=None):
    app = ra.build()
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (remote, 4242) \
        if name == "peername" else default
    req = make_mocked_request(method, path, headers=headers or {}, app=app, transport=transport)
    match = await app.router.resolve(req)
    req._match_info = match

    async def handler(request):
        return web.json_response({"reached": True})

    return await ra.middleware(req, handler)


def test_router_admin_routes_loopback_only_without_admin_key():
    from router.config import RouterConfig

    async def run():
        ra = _router_app()
        for method, path in (("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers/abc"),
                             ("POST", "/flush_cache")):
            far = await _through_middleware(ra, method, path, "10.9.8.7")
            assert far.status == 403, (method, path)
            assert json.loads(far.body)["error"]["type"] == "permission_error"
            assert (await _through_middleware(ra, method, path, "127.0.0.1")).status == 200
        assert (await _through_middleware(ra, "GET", "/v1/models", "10.9.8.7")).status == 200
        ra = _router_app(keys=Keys(client=C, admin=A))
        assert (await _through_middleware(ra, "GET", "/workers", "127.0.0.1",
                                          {"Authorization": "Bearer client-k"})).status == 401
        assert (await _through_middleware(ra, "GET", "/workers", "10.9.8.7",
                                          {"Authorization": "Bearer admin-k"})).status == 200
        assert (await _through_middleware(ra, "GET", "/health", "10.9.8.7")).status == 200
        assert RouterConfig(api_key="x").resolved_keys.client == b"x" \
            and "x'" not in repr(RouterConfig(api_key="x"))

    asyncio.run(run())


def test_router_openapi_describes_every_route():
    from common.server.openapi import openapi_document

    doc = json.loads(msgspec.json.encode(openapi_document("t", "0", _router_app().routes)))
    assert {"/generate", "/v1/chat/completions", "/workers", "/workers/{id}", "/openapi.json"} \
        <= set(doc["paths"])
    room = doc["components"]["schemas"]["GenerateRequest"]["properties"]["bootstrap_room"]["anyOf"][0]
    assert room["maximum"] == 2**63 - 1 and room["minimum"] == 0
    assert doc["paths"]["/workers"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
