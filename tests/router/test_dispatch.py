"""Per-request behaviour through a real router process and recording workers on 127.0.0.1."""

from __future__ import annotations

import http.client as httpclient
import json
import threading

import pytest

from tests.harness.client import http, metric_total, wait_until


def _stream(router_url: str, path: str, body: dict):
    host = router_url.split("//")[1]
    conn = httpclient.HTTPConnection(host, timeout=30)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_injection_fields_and_types(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    status, headers, body = r.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4},
                                                 "return_text_in_logprobs": True})
    assert status == 200, body
    pb, db = p.requests()[0]["body"], d.requests()[0]["body"]
    assert pb == db  # both legs get the same request
    assert db["bootstrap_host"] == "127.0.0.1"
    assert db["bootstrap_port"] == 8998 and isinstance(db["bootstrap_port"], int)
    assert isinstance(db["bootstrap_room"], int) and 0 <= db["bootstrap_room"] < 2**63
    assert isinstance(db["rid"], str) and db["rid"]
    assert db["return_text_in_logprobs"] is True and db["text"] == "hello"
    assert json.loads(body)["meta_info"]["worker"].startswith("decode")  # the client gets the decode leg
    # OpenAI shapes get the same fields
    for path, req in (("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, _, body = r.post(path, req)
        assert status == 200, body
        sent = [x for x in d.requests() if x["path"] == path][0]["body"]
        assert sent["bootstrap_port"] == 8998 and isinstance(sent["bootstrap_room"], int)
        assert isinstance(sent["rid"], str)


def test_client_rid_kept_and_rooms_fresh(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "random")
    for _ in range(2):
        assert r.post("/generate", {"text": "x", "rid": "client-rid-1"})[0] == 200
    sent = [x["body"] for x in d.requests()]
    assert [s["rid"] for s in sent] == ["client-rid-1", "client-rid-1"]
    assert sent[0]["bootstrap_room"] != sent[1]["bootstrap_room"]


def test_batch_rooms_distinct(workers, make_router):
    p, d = workers["p"][1], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    assert r.post("/generate", {"text": ["a", "b", "c", "d"]})[0] == 200
    assert r.post("/generate", {"input_ids": [[1, 2], [3, 4], [5]]})[0] == 200
    assert r.post("/v1/completions", {"prompt": ["x", "y"]})[0] == 200
    sent = [x["body"] for x in d.requests()]
    for body, n in zip(sent, (4, 3, 2), strict=True):
        rooms = body["bootstrap_room"]
        assert isinstance(rooms, list) and len(rooms) == n and len(set(rooms)) == n
        assert all(isinstance(x, int) and 0 <= x < 2**63 for x in rooms)
        assert body["bootstrap_host"] == ["127.0.0.1"] * n and body["bootstrap_port"] == [8999] * n
    assert len(sent[0]["rid"]) == 4 and len(set(sent[0]["rid"])) == 4  # one rid per input
    assert len(sent[2]["rid"]) == 2 and len(set(sent[2]["rid"])) == 2
    assert p.requests()[0]["body"]["bootstrap_room"] == sent[0]["bootstrap_room"]


def test_both_legs_concurrent(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    p.config(hold=1)  # the prefill leg does not answer until released
    d.config(hold=1)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=r.post("/generate", {"text": "hi"})))
    t.start()
    # both workers have the request while neither has answered: the legs were sent together
    wait_until(lambda: p.requests() and d.requests(), what="both legs at their workers")
    assert not p.requests()[0]["done"] and not d.requests()[0]["done"]
    p.release()
    d.release()
    t.join(30)
    assert result["out"][0] == 200


def test_stream_starts_before_prefill_completes(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    p.config(hold=1)
    d.config(chunks=3)
    conn, resp = _stream(r.url, "/generate", {"text": "hi", "stream": True})
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ") and b"out0" in first
    # the client has stream bytes while the prefill leg is still held
    assert p.requests() and not p.requests()[0]["done"]
    p.release()
    rest = resp.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    conn.close()


def test_a_client_that_hangs_up_after_done_was_served(workers, make_router):
    """[DONE] ends the relay: a client closing right after it is a 200, not a disconnect, and the worker's
    request is not aborted; a text that spells `data: [DONE]` does not end the stream early."""
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    d.config(chunks=3, text="\n\ndata: [DONE]\n\n{i}", eof_delay=0.5)
    for k in range(5):
        conn, resp = _stream(r.url, "/generate", {"text": "hi", "stream": True, "rid": f"hangup-{k}"})
        events = []
        while (line := resp.readline()) != b"data: [DONE]\n":
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        conn.close()  # before the chunked body's end
        assert [e["text"] for e in events] == [f"\n\ndata: [DONE]\n\n{i}" for i in range(3)]
    wait_until(lambda: r.log_path.read_text().count("/generate status=") == 5, timeout=10)
    log = r.log_path.read_text()
    assert all(f"rid=hangup-{k} /generate status=200" in log for k in range(5)), log
    assert "pdserve_router_client_disconnects_total 0" in http("GET", r.url + "/metrics")[2].decode()
    assert d.aborts() == []


def test_logprobs_merged(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    status, _, body = r.post("/generate", {"text": "hi", "return_logprob": True})
    assert status == 200
    assert json.loads(body)["meta_info"]["input_token_logprobs"] == [[-1.0, 11, None], [-1.5, 12, None],
                                                                     [-2.0, 13, None]]
    status, _, body = r.post("/generate", {"text": "hi", "return_logprob": True, "stream": True})
    events = [json.loads(x[6:]) for x in body.decode().split("\n\n") if x.startswith("data: {")]
    assert events and all(e["meta_info"]["input_token_logprobs"][:2] == [[-1.0, 11, None], [-1.5, 12, None]]
                          for e in events)


def test_status_preserved_429(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", "--retry-max-retries", "2")
    d.config(status=429)
    status, _, body = r.post("/generate", {"text": "hi"})
    assert status == 429 and b"says 429" in body
    status, _, body = r.post("/generate", {"text": "hi", "stream": True})
    assert status == 429 and json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    assert len(d.requests()) == 2  # a worker's 429 is passed through, never retried
    d.config(status=400)  # not retryable: passed through at once
    status, _, _ = r.post("/generate", {"text": "hi"})
    assert status == 400 and len(d.requests()) == 3


def _run_two(r, body):
    results = []
    threads = [threading.Thread(target=lambda: results.append(r.post("/generate", body))) for _ in range(2)]
    for t in threads:
        t.start()
    return threads, results


def test_retry_aborts_orphan_decode_leg(workers, make_router):
    (p0, p1), d = workers["p"], workers["d"][0]
    r = make_router([p0, p1], [d], "--prefill-policy", "round_robin", "--decode-policy", "random")
    p0.config(status=503)
    d.config(hold=-1)  # decode legs wait (as for their KV) until released or aborted
    # round robin: one of them tries p0 first, or both do when one retries before the other is routed
    threads, results = _run_two(r, {"text": "hi"})
    wait_until(lambda: len(p1.requests()) == 2 and 0 < len(d.aborts()) == len(p0.requests())
               and len(d.requests()) == 2 + len(p0.requests()), what="abort and retry")
    failed = len(p0.requests())
    # every abandoned decode leg was aborted on its node
    assert sorted(d.aborts()) == sorted(x["body"]["rid"] for x in p0.requests())
    d.release()
    for t in threads:
        t.join(30)
    assert [x[0] for x in results] == [200, 200]
    sent = [x["body"] for x in d.requests()]
    assert len({s["bootstrap_room"] for s in sent}) == 2 + failed \
        and len({s["rid"] for s in sent}) == 2 + failed
    assert len(p1.requests()) == 2  # the retry re-sent both legs, avoiding the failed worker
    retry = [s for s in sent if s["rid"] not in {x["body"]["rid"] for x in p0.requests()}]
    assert sorted(x["body"]["bootstrap_room"] for x in p1.requests()) \
        == sorted(s["bootstrap_room"] for s in retry)


def test_a_retry_of_a_client_rid_runs_under_its_own_rid(workers, make_router):
    # the abort of the abandoned attempt must not meet the retry on a node (nor the node refuse its rid)
    (p0, p1), d = workers["p"], workers["d"][0]
    r = make_router([p0, p1], [d], "--prefill-policy", "round_robin", "--decode-policy", "random")
    p0.config(status=503)
    d.config(delay=0.3)  # the decode answers after the prefill's 503 (a real decode waits for the KV)
    for _ in range(2):  # round robin: one of the two meets p0 first
        assert r.post("/generate", {"text": "hi", "rid": "mine"})[0] == 200
    failed = len(p0.requests())  # attempts that met p0's 503 (each retried once, on p1)
    assert failed >= 1 and [x["body"]["rid"] for x in p0.requests()] == ["mine"] * failed
    # every request's last attempt reached p1 (its prefill leg may still be on the way when the answer is in)
    wait_until(lambda: len(p1.requests()) == 2, what="both prefill legs on p1")
    rids = sorted(x["body"]["rid"] for x in p1.requests())
    assert rids == ["mine"] * (2 - failed) + ["mine-retry1"] * failed, rids


def test_decode_failure_aborts_prefill_leg(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--prefill-policy", "random", "--decode-policy", "round_robin")
    p.config(hold=-1)
    d0.config(status=503)
    threads, results = _run_two(r, {"text": "hi", "stream": True})  # one or both meet d0 first (see above)
    wait_until(lambda: len(d1.requests()) == 2 and 0 < len(p.aborts()) == len(d0.requests())
               and len(p.requests()) == 2 + len(d0.requests()), what="abort and retry")
    assert sorted(p.aborts()) == sorted(x["body"]["rid"] for x in d0.requests())
    p.release()
    for t in threads:
        t.join(30)
    assert [x[0] for x in results] == [200, 200]
    assert all(x[2].rstrip().endswith(b"data: [DONE]") for x in results)
    assert len(d1.requests()) == 2


def test_a_decode_stream_ending_in_an_error_aborts_the_waiting_prefill_leg(workers, make_router):
    """A decode whose request failed after its stream began (its transfer failed: the prefill it talked to
    had restarted) ends the stream with an error event; its prefill leg would wait for a TransferInfo until
    its bootstrap timeout, so the router aborts it instead of waiting."""
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    p.config(hold=-1)
    d.config(error_event=True)
    status, _, body = r.post("/generate", {"text": "hi", "stream": True})
    assert status == 200 and b'"error":' in body and body.rstrip().endswith(b"data: [DONE]")
    wait_until(lambda: p.aborts() == [d.requests()[0]["body"]["rid"]], what="the prefill leg aborted")
    p.release()


@pytest.mark.parametrize("path,body", [("/generate", {"text": "hi"}),
                                       ("/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_stream_whose_decode_fails_before_its_first_token_runs_again_on_another_pair(workers, make_router,
                                                                                        path, body):
    """A decode whose KV transfer failed before its first token (its stream's first event with a token is an
    error; a chat stream's role chunk before it is held back) has sent the client nothing: the router runs the
    request again on the other pair, with a fresh room and the abandoned prefill leg aborted, and the client
    sees one clean stream."""
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--prefill-policy", "random", "--decode-policy", "round_robin")
    p.config(hold=-1)  # a prefill leg waits for its transfer, as a real one would
    d0.config(error_first=1)
    d1.config(error_first=1)  # each fails its first request: attempts 1 and 2 fail, the third answers
    status, _, out = r.post(path, {**body, "stream": True})
    assert status == 200 and b'"error"' not in out and b"out2" in out, out
    assert out.rstrip().endswith(b"data: [DONE]")
    attempts = sorted(d0.requests() + d1.requests(), key=lambda x: x["t"])
    assert len(attempts) == 3 and len({a["body"]["bootstrap_room"] for a in attempts}) == 3
    assert attempts[0]["body"]["bootstrap_room"] != attempts[1]["body"]["bootstrap_room"]
    wait_until(lambda: all(a["body"]["rid"] in p.aborts() for a in attempts[:2]),
               what="the failed attempts' prefill legs aborted")
    assert metric_total(r.url, "pdserve_router_reruns_before_first_token_total") == 2
    p.release()


def test_an_error_before_the_first_token_that_is_the_requests_own_is_relayed(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    d.config(error_event=True, chunks=0)  # an error event of another type (server_error): not re-run
    status, _, body = r.post("/generate", {"text": "hi", "stream": True})
    assert status == 200 and b'"error"' in body, body
    assert len(d.requests()) == 1 \
        and metric_total(r.url, "pdserve_router_reruns_before_first_token_total") == 0


def test_mid_stream_failure_is_sse_error_then_done(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    d.config(chunks=5, break_after=2)
    status, _, body = r.post("/generate", {"text": "hi", "stream": True})
    assert status == 200
    events = [e for e in body.decode().split("\n\n") if e]
    assert b"out1" in body and b"out2" not in body
    err = json.loads(events[-2][len("data: "):])
    assert err["error"]["type"] == "upstream_error" and "decode" in err["error"]["message"]
    assert events[-1] == "data: [DONE]"


def test_client_disconnect_aborts_both_legs(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    p.config(hold=1)
    d.config(chunks=1000, chunk_delay=0.05)
    conn, resp = _stream(r.url, "/generate", {"text": "hi", "stream": True})
    assert resp.readline().startswith(b"data: ")
    rid = d.requests()[0]["body"]["rid"]
    conn.sock.close()
    conn.close()
    wait_until(lambda: rid in d.aborts() and rid in p.aborts(), what="aborts of both legs")


def test_client_disconnect_aborts_every_item_of_a_batch(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    p.config(hold=1)
    d.config(chunks=1000, chunk_delay=0.05)
    # one client rid for two prompts: the nodes run them as mine-0 and mine-1, and that is what gets aborted
    conn, resp = _stream(r.url, "/v1/completions", {"prompt": ["a", "b"], "rid": "mine", "stream": True})
    assert resp.readline().startswith(b"data: ")
    assert d.requests()[0]["body"]["rid"] == "mine"
    conn.sock.close()
    conn.close()
    items = {"mine-0", "mine-1"}
    wait_until(lambda: items <= set(d.aborts()) and items <= set(p.aborts()), what="aborts of every item")


def test_request_id_and_api_key(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin", "--api-key", "sekret")
    status, _, body = r.post("/generate", {"text": "hi"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert http("GET", r.url + "/health")[0] == 200  # probes stay open
    status, headers, _ = r.post("/generate", {"text": "hi"}, {"Authorization": "Bearer sekret",
                                                              "X-Request-ID": "trace-42"})
    assert status == 200 and headers["x-request-id"] == "trace-42"
    for w in (p, d):
        h = {k.lower(): v for k, v in w.requests()[-1]["headers"].items()}
        assert h["x-request-id"] == "trace-42" and h["authorization"] == "Bearer sekret"
    status, headers, _ = r.post("/generate", {"text": "hi"}, {"Authorization": "Bearer sekret"})
    assert status == 200 and len(headers["x-request-id"]) == 32
    log = r.log_path.read_text()
    assert "rid=trace-42 /generate status=200" in log and f"decode={d.url}" in log


def test_malformed_input_400_names_field(workers, make_router):
    p, d = workers["p"][0], workers["d"][0]
    r = make_router([p], [d], "--policy", "round_robin")
    cases = [
        ("/generate", b"{not json", "malformed JSON"),
        ("/generate", b"[1, 2]", "JSON object"),
        ("/generate", {"sampling_params": {}}, "`text`"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ("/generate", {"text": "x", "sampling_params": {"top_p": 2}}, "top_p"),
        ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
        ("/generate", {"text": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),
        ("/generate", {"text": "x", "image_data": "y"}, "`image_data`"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "return_hidden_states": True},
         "`return_hidden_states`"),
        ("/v1/completions", {"prompt": ["x", "y"], "rid": ["a"]}, "`rid`"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
         "`max_completion_tokens`"),
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
         "temperature"),
    ]
    for path, body, field in cases:
        status, _, out = r.post(path, body if isinstance(body, bytes) else json.dumps(body).encode())
        err = json.loads(out)["error"]
        assert status == 400 and err["code"] in ("invalid_value", "unknown_parameter",
                                                 "invalid_request", "unsupported_value") \
            and err["type"] == "invalid_request_error", (path, body, out)
        assert field in err["message"], (field, err["message"])
    assert d.requests() == [] and p.requests() == []  # nothing invalid reached a worker


def test_local_prefill_while_the_prefill_worker_is_busy(workers, make_router):
    """--local-prefill-queue 1: with a prefill leg in flight, the next request goes to a decode worker that
    prefills locally, alone and without a rendezvous (client-sent rendezvous fields dropped); a second only
    once two prefill legs are in flight; a decode worker that does not say it prefills locally never gets
    one."""
    p, d, plain = workers["p"][0], workers["d"][0], workers["d"][1]
    d.config(info={"disaggregation_local_prefill": True})
    r = make_router([p], [d], "--policy", "round_robin", "--local-prefill-queue", "1")
    p.config(hold=1)  # the first request's prefill leg stays in flight
    # its decode leg answered; the prefill leg is held
    assert r.post("/generate", {"text": "first"})[0] == 200
    assert len(p.requests()) == 1
    d.config(hold=1)  # the local request waits at the decode worker (its first byte not sent)
    held = {}
    t = threading.Thread(target=lambda: held.update(out=r.post("/generate", {
        "text": "second", "bootstrap_room": 5, "bootstrap_host": "10.0.0.9", "bootstrap_port": 1})))
    t.start()
    wait_until(lambda: len(d.requests()) == 2, what="the local request at the decode worker")
    local = d.requests()[1]["body"]
    assert local["text"] == "second" and isinstance(local["rid"], str)
    assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(local)
    assert len(p.requests()) == 1  # no prefill leg for it
    # with one local prefill waiting and one prefill leg in flight, the next request goes to the prefill
    # worker as usual (its leg held too: two in flight)
    p.config(hold=1)
    status, _, body = r.post("/generate", {"text": "third", "stream": True})
    assert status == 200, body
    assert [x["body"]["text"] for x in p.requests()] == ["first", "third"]
    third = [x["body"] for x in d.requests() if x["body"]["text"] == "third"][0]
    assert third["bootstrap_room"] == p.requests()[1]["body"]["bootstrap_room"]
    # two prefill legs in flight: enough for a second local prefill
    d.config(hold=1)
    t2 = threading.Thread(target=lambda: held.update(out2=r.post("/generate", {"text": "fourth"})))
    t2.start()
    wait_until(lambda: any(x["body"]["text"] == "fourth" for x in d.requests()),
               what="the second local request")
    fourth = [x["body"] for x in d.requests() if x["body"]["text"] == "fourth"][0]
    assert "bootstrap_room" not in fourth and len(p.requests()) == 2
    d.release()
    t.join(30)
    t2.join(30)
    assert held["out"][0] == 200 and held["out2"][0] == 200
    p.release()
    metrics = http("GET", r.url + "/metrics")[2].decode()
    assert f'pdserve_router_local_prefills_total{{worker="{d.url}"}} 2.0' in metrics
    # a prompt the decode worker refuses to prefill (over its --disaggregation-local-prefill-max-tokens): the
    # same attempt again with both legs, for stream and non-stream alike, and no retry counted
    d.config(refuse_local=True)
    retries = metric_total(r.url, "pdserve_router_retries_total")
    for stream in (False, True):
        p.config(hold=1)
        t = threading.Thread(target=lambda: r.post("/generate", {"text": "busy"}))
        t.start()
        wait_until(lambda: p.requests()[-1]["body"]["text"] == "busy", what="a prefill leg in flight")
        status, _, body = r.post("/generate", {"text": f"long-{stream}", "stream": stream})
        assert status == 200, body
        tries = [x["body"] for x in d.requests() if x["body"]["text"] == f"long-{stream}"]
        assert len(tries) == 2 and "bootstrap_room" not in tries[0]
        assert tries[1]["bootstrap_room"] == p.requests()[-1]["body"]["bootstrap_room"]
        p.release()
        t.join(30)
    assert metric_total(r.url, "pdserve_router_local_prefill_refusals_total") == 2
    assert metric_total(r.url, "pdserve_router_retries_total") == retries
    d.config(refuse_local=False)
    # a decode worker without --disaggregation-local-prefill: both legs, however busy the prefill worker is
    r2 = make_router([p], [plain], "--policy", "round_robin", "--local-prefill-queue", "1")
    p.config(hold=2)
    for text in ("a", "b"):
        assert r2.post("/generate", {"text": text})[0] == 200
    # (the decode leg can answer before the prefill leg's request is recorded: ci91 saw "b" not there yet)
    wait_until(lambda: [x["body"]["text"] for x in p.requests()][-2:] == ["a", "b"], what="both prefill legs")
    p.release()
