"""Worker registry: startup registration, health transitions, runtime add/remove, info endpoints."""

from __future__ import annotations

import json
from urllib.parse import quote

from tests.harness.client import get_json, http, wait_until


def _worker(router, url):
    return next((w for w in get_json(router.url + "/workers")["workers"] if w["url"] == url), None)


def test_registration_reads_server_info(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", ports={p: None})
    info = _worker(r, p.url)
    assert info["worker_type"] == "prefill" and info["disaggregation_mode"] == "prefill"
    assert info["bootstrap_port"] == 8998  # no port on the command line: taken from server_info
    assert info["model_path"] == "test-model"
    assert get_json(r.url + "/get_model_info")["model_path"] == "test-model"
    assert get_json(r.url + "/get_server_info")["disaggregation_mode"] == "prefill"
    assert get_json(r.url + "/v1/models")["data"][0]["id"] == "test-model"
    loads = get_json(r.url + "/get_loads")["workers"]
    assert {x["worker"] for x in loads} == {p.url, d.url} and all(x["load"] == 0 for x in loads)
    from importlib.metadata import version

    assert get_json(r.url + "/version") == {"version": version("pdserve")}
    metrics = http("GET", r.url + "/metrics")[2].decode()
    assert f'smg_worker_health{{worker="{p.url}"}} 1.0' in metrics


def test_explicit_none_bootstrap_port_is_null(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", ports={p: "none"})
    assert r.post("/generate", {"text": "x"})[0] == 200
    assert d.requests()[0]["body"]["bootstrap_port"] is None


def test_startup_waits_for_health(workers, make_worker, make_router):
    d = workers["d"][0]
    late = make_worker("prefill", 9100)
    late.config(health=503)
    r = make_router([late], [d], "--policy", "round_robin", wait=False)

    def up():
        try:
            return http("GET", r.url + "/health", timeout=1)[0] == 200
        except OSError:
            return False

    wait_until(up, what="router up")
    assert http("GET", r.url + "/readiness")[0] == 503
    status, _, body = r.post("/generate", {"text": "x"})
    assert status == 503 and "prefill" in json.loads(body)["error"]["message"]
    late.config(health=200)
    r.wait_ready()
    assert r.post("/generate", {"text": "x"})[0] == 200


def test_health_transitions(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--policy", "round_robin", "--health-check-interval-secs", "0.1",
                    "--health-failure-threshold", "2", "--health-success-threshold", "2")
    d0.config(health=503)
    wait_until(lambda: not _worker(r, d0.url)["is_healthy"], what="d0 unhealthy")
    assert _worker(r, d1.url)["is_healthy"]
    for _ in range(6):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert len(d0.requests()) == 0 and len(d1.requests()) == 6  # unhealthy workers get no traffic
    d1.config(health=503)
    wait_until(lambda: not _worker(r, d1.url)["is_healthy"], what="d1 unhealthy")
    assert http("GET", r.url + "/readiness")[0] == 503
    assert r.post("/generate", {"text": "x"})[0] == 503
    d0.config(health=200)
    wait_until(lambda: _worker(r, d0.url)["is_healthy"], what="d0 healthy again")
    assert http("GET", r.url + "/readiness")[0] == 200
    assert r.post("/generate", {"text": "x"})[0] == 200 and len(d0.requests()) == 1


def test_circuit_breaker_opens(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--policy", "round_robin", "--cb-failure-threshold", "2",
                    "--cb-timeout-duration-secs", "600", "--retry-max-retries", "3")
    d0.config(status=500)
    for _ in range(6):
        assert r.post("/generate", {"text": "x"})[0] == 200  # retried on d1
    assert _worker(r, d0.url)["circuit_breaker"] == "open"
    assert len(d0.requests()) == 2  # no traffic once open


def test_a_failed_kv_transfer_opens_no_breaker(workers, make_router):
    """A decode answering 500 with the KV transfer named as the cause (the prefill or the link failed it) is
    retried but not held against the decode: its breaker stays closed while plain 500s open it."""
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--policy", "round_robin", "--cb-failure-threshold", "2",
                    "--cb-timeout-duration-secs", "600", "--retry-max-retries", "3")
    d0.config(status=500, err_type="kv_transfer")
    for _ in range(6):
        assert r.post("/generate", {"text": "x"})[0] == 200  # retried on d1
    assert _worker(r, d0.url)["circuit_breaker"] == "closed"
    assert len(d0.requests()) >= 3  # an open breaker would have stopped at 2
    d0.config(err_type=None)
    for _ in range(6):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert _worker(r, d0.url)["circuit_breaker"] == "open"


def test_a_breaker_opened_before_a_restart_lets_traffic_through_once_healthy(workers, make_router):
    """A node that failed its health checks and passes them again (restarted) gets traffic at once: its
    open breaker goes half-open instead of waiting out --cb-timeout-duration-secs."""
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--policy", "round_robin", "--cb-failure-threshold", "2",
                    "--cb-timeout-duration-secs", "600", "--retry-max-retries", "3",
                    "--health-check-interval-secs", "0.1", "--health-failure-threshold", "2",
                    "--health-success-threshold", "2", "--cb-success-threshold", "2")
    d0.config(status=500)
    for _ in range(6):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert _worker(r, d0.url)["circuit_breaker"] == "open"
    d0.config(health=503)
    wait_until(lambda: not _worker(r, d0.url)["is_healthy"], what="d0 unhealthy")
    d0.config(status=200, health=200)
    wait_until(lambda: _worker(r, d0.url)["is_healthy"], what="d0 healthy again")
    assert _worker(r, d0.url)["circuit_breaker"] == "half_open"
    d0.reset()
    for _ in range(4):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert len(d0.requests()) == 2 and _worker(r, d0.url)["circuit_breaker"] == "closed"


def test_runtime_add_and_remove(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0], "--policy", "round_robin")
    status, _, body = r.post("/workers", {"url": d1.url, "worker_type": "decode"})
    assert status == 200, body
    wid = json.loads(body)["worker"]["id"]
    assert _worker(r, d1.url)["worker_type"] == "decode"
    assert r.post("/workers", {"url": d1.url, "worker_type": "decode"})[0] == 409
    assert r.post("/workers", {"worker_type": "decode"})[0] == 400
    for _ in range(4):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert len(d0.requests()) == 2 and len(d1.requests()) == 2
    assert http("DELETE", f"{r.url}/workers/{wid}")[0] == 200
    assert _worker(r, d1.url) is None
    for _ in range(3):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert len(d1.requests()) == 2 and len(d0.requests()) == 5
    # a prefill worker added at runtime, removed by its URL
    p1 = workers["p"][1]
    status, _, body = r.post("/workers", {"url": p1.url, "worker_type": "prefill", "bootstrap_port": 7777})
    assert status == 200 and json.loads(body)["worker"]["bootstrap_port"] == 7777
    assert http("DELETE", f"{r.url}/workers/{quote(p1.url, safe='')}")[0] == 200
    assert http("DELETE", f"{r.url}/workers/nope")[0] == 404
