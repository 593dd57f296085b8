"""The router under overload, through a real router process and recording workers: its own concurrency
limit, queue, queue timeout, request-rate limit and body limit (router/limits.py), and what it does with
workers' overload answers (429 passed through, 503 retried once elsewhere, breakers left closed)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

from tests.harness.client import get_json, http, wait_until


def _admission(r) -> dict:
    return get_json(r.url + "/get_server_info")["router"]


def _metric(r, name: str) -> float:
    _, _, body = http("GET", r.url + "/metrics")
    for line in body.decode().splitlines():
        key, _, value = line.rpartition(" ")
        if key == name or key == name + "_total":
            return float(value)
    raise AssertionError(f"{name} not in /metrics")


def _breakers(r) -> dict:
    return {w["url"]: w["circuit_breaker"] for w in get_json(r.url + "/workers")["workers"]}


def _message(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


def test_concurrency_limit_queue_and_429(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", "--max-concurrent-requests",
                    "2", "--queue-size", "2")
    d.config(hold=2)  # the first two requests stay in flight until released
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(r.post, "/generate", {"text": f"q{i}"}) for i in range(6)]
        wait_until(lambda: len(d.requests()) == 2 and _admission(r)["queued"] == 2,
                   what="2 in flight, 2 queued")
        wait_until(lambda: sum(f.done() for f in futs) == 2, what="both refused")
        info = _admission(r)
        assert (info["in_flight"], info["queued"], info["rejected"]) == (2, 2, {"queue_full": 2})
        assert _metric(r, "pdserve_router_queued_requests") == 2
        assert _metric(r, "pdserve_router_in_flight_requests") == 2
        d.release()
        results = [f.result(timeout=20) for f in futs]
    statuses = sorted(s for s, _, _ in results)
    assert statuses == [200, 200, 200, 200, 429, 429]
    for status, headers, body in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            err = json.loads(body)["error"]
            assert err["code"] == "rate_limit_exceeded" and "--max-concurrent-requests 2" in err["message"]
            assert "--queue-size 2" in err["message"]
    assert len(d.requests()) == 4  # the refused never reached a worker
    info = _admission(r)
    assert (info["in_flight"], info["queued"]) == (0, 0)
    # only the generation routes are limited
    d.config(hold=2)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(r.post, "/generate", {"text": "x"}) for _ in range(2)]
        wait_until(lambda: len(d.requests()) == 6, what="two in flight")
        assert http("GET", r.url + "/health")[0] == 200
        assert http("GET", r.url + "/metrics")[0] == 200
        assert http("GET", r.url + "/workers")[0] == 200
        d.release()
        assert [f.result(timeout=20)[0] for f in futs] == [200, 200]


def test_queue_timeout_is_408_and_a_leaving_client_leaves_the_queue(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", "--max-concurrent-requests",
                    "1", "--queue-size", "1", "--queue-timeout-secs", "0.5")
    d.config(hold=1)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        first = ex.submit(r.post, "/generate", {"text": "held", "stream": True})  # a stream holds its place
        wait_until(lambda: len(d.requests()) == 1, what="the first request in flight")
        t0 = time.monotonic()
        status, headers, body = r.post("/generate", {"text": "waits"})
        waited = time.monotonic() - t0
        assert status == 408 and 0.4 < waited < 5, (status, waited, body)
        assert "--queue-timeout-secs 0.5" in _message(body) and "retry-after" in headers
        # a client that goes away while queued is taken off the queue
        host, port = r.url.split("//")[1].split(":")
        s = socket.create_connection((host, int(port)))
        data = b'{"text": "gone"}'
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(data)).encode() + b"\r\n\r\n" + data)
        wait_until(lambda: _admission(r)["queued"] == 1, what="the request queued")
        s.close()
        wait_until(lambda: _admission(r)["queued"] == 0, what="the queue emptied", timeout=5)
        assert _admission(r)["in_flight"] == 1
        d.release()
        status, _, body = first.result(timeout=20)
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    info = _admission(r)
    assert (info["in_flight"], info["queued"], info["rejected"]) == (0, 0, {"queue_timeout": 1})
    assert len(d.requests()) == 1  # neither the timed-out nor the departed request reached a worker


def test_rate_limit_tokens_per_second(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", "--max-concurrent-requests", "2",
                    "--rate-limit-tokens-per-second", "1", "--queue-size", "1")
    # the bucket holds 2 tokens (--max-concurrent-requests): two requests pass, a third waits for the
    # refill (1 s at 1/s) although a place is free, a fourth finds the queue full
    assert r.post("/generate", {"text": "a"})[0] == 200
    assert r.post("/generate", {"text": "b"})[0] == 200
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        t0 = time.monotonic()
        waiting = ex.submit(r.post, "/generate", {"text": "c"})
        wait_until(lambda: waiting.done() or _admission(r)["queued"] == 1, what="the third request queued")
        status, headers, body = r.post("/generate", {"text": "d"})  # the queue (1) is full
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert "--rate-limit-tokens-per-second 1" in _message(body)
        assert waiting.result(timeout=10)[0] == 200
        assert time.monotonic() - t0 > 0.5
    assert len(d.requests()) == 3
    assert _admission(r)["rejected"] == {"queue_full": 1}


def _raw(r, head: bytes, body: bytes) -> tuple[int, dict, bytes]:
    """Send a request head and part of a body, then read the answer (the rest is never sent)."""
    host, port = r.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        headers = {}
        while (line := f.readline().strip()):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers, f.read(int(headers["content-length"]))


def test_body_limit_413_before_reading(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", "--max-payload-size", "1000")
    assert r.post("/generate", {"text": "x" * 900})[0] == 200  # under the limit
    # a declared length far over the limit: refused before the body is read (only 100 bytes are sent)
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000000\r\n\r\n")
    status, headers, body = _raw(r, head, b'{"text": "' + b"x" * 90)
    assert status == 413 and "--max-payload-size" in _message(body)
    assert headers.get("connection", "").lower() == "close"
    # a chunked body is cut off once it passes the limit (no final chunk is ever sent)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"258\r\n" + b"x" * 600 + b"\r\n"
    status, _, body = _raw(r, head, chunk * 2)
    assert status == 413 and "stopped reading" in _message(body)
    assert len(d.requests()) == 1
    assert _admission(r)["rejected"] == {"payload_too_large": 2}


def test_worker_429_passed_through_without_retry(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                    "--cb-failure-threshold", "1")
    d0.config(status=429, retry_after=7)
    results = [r.post("/generate", {"text": "x", "stream": i % 2 == 1}) for i in range(4)]
    assert sorted(s for s, _, _ in results) == [200, 200, 429, 429]
    for status, headers, body in results:
        if status == 429:
            assert headers["retry-after"] == "7" and "says 429" in _message(body)
    assert len(d0.requests()) == 2 and len(d1.requests()) == 2  # no retries
    assert set(_breakers(r).values()) == {"closed"}
    # a prefill worker's 429 too; without its own Retry-After the router gives one
    for d in (d0, d1):  # decode answers after the prefill's (a real decode waits for the KV)
        d.config(status=200, retry_after=None, delay=0.3)
    p.config(status=429)
    status, headers, body = r.post("/generate", {"text": "x"})
    assert status == 429 and headers["retry-after"] == "1"
    assert len(p.requests()) == 5
    assert set(_breakers(r).values()) == {"closed"}
    assert _metric(r, "pdserve_router_worker_overload_answers_total") == 3


def test_worker_503_retried_once_on_another_worker(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                    "--cb-failure-threshold", "1", "--retry-max-retries", "5")
    d0.config(status=503)
    for _ in range(2):
        assert r.post("/generate", {"text": "x"})[0] == 200
    # every request ended on d1; each that met d0's 503 was retried there once
    assert len(d1.requests()) == 2 and 1 <= len(d0.requests()) <= 2
    assert _metric(r, "pdserve_router_retries_total") == len(d0.requests())
    # both overloaded: one retry, then the 503 goes back (not five tries)
    d1.config(status=503)
    before = len(d0.requests()) + len(d1.requests())
    status, _, body = r.post("/generate", {"text": "x"})
    assert status == 503 and "says 503" in _message(body)
    assert len(d0.requests()) + len(d1.requests()) == before + 2
    assert set(_breakers(r).values()) == {"closed"}
    # one prefill worker only: no other worker to retry on
    for d in (d0, d1):  # decode answers after the prefill's (a real decode waits for the KV)
        d.config(status=200, delay=0.3)
    p.config(status=503)
    before = len(p.requests())
    assert r.post("/generate", {"text": "x"})[0] == 503
    assert len(p.requests()) == before + 1
    assert set(_breakers(r).values()) == {"closed"}


def test_worker_504_deadline_passed_through_without_retry(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--decode-policy", "round_robin", "--cb-failure-threshold", "1",
                    "--retry-max-retries", "5")
    for d in (d0, d1):  # a node's --request-timeout answer
        d.config(status=504)
    status, _, body = r.post("/generate", {"text": "x"})
    assert status == 504 and "says 504" in _message(body)
    assert len(d0.requests()) + len(d1.requests()) == 1  # not retried
    assert set(_breakers(r).values()) == {"closed"}
