"""Bad input gets a 4xx whose message names the field, and the node keeps serving (a real node with an
API key, serving the tiny random model on 127.0.0.1)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest

from tests.harness.client import http_get, http_post
from tests.harness.hooks import HOOKS, slow_forwards

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 64


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("node-hooks")


@pytest.fixture(scope="module")
def node(tiny_model_dir, module_launcher, control_dir):
    # the test-only hooks let a test slow the forwards, so a request is still running when it needs
    return module_launcher.colocated(tiny_model_dir, max_total_tokens=2048,
                                     max_running_requests=4, api_key=KEY, context_length=CONTEXT,
                                     env={"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(control_dir)})


def post(node, path, body, status, *fields, headers=AUTH):
    """POST and check the status and that the error message names every given field."""
    code, raw = http_post(node.url + path, body, headers=headers)
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["code"], str | None)
    for f in fields:
        assert f in err["message"], (f, err["message"])
    named = [f.strip("`") for f in fields if f.startswith("`") and f.endswith("`") and f.count("`") == 2]
    if status == 400 and named:  # OpenAI's `param`: the field the message names first
        assert err["param"] == named[0], (err, named)
    return err["message"]


def ok(node):
    code, raw = http_post(node.url + "/generate", {"text": "still alive?", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, headers=AUTH)
    assert code == 200, raw
    assert json.loads(raw)["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("body,fields", [
    (b"{not json", ["malformed JSON"]),
    (b"", ["body is empty"]),
    (b"[1, 2]", ["Expected `object`"]),
    ({"text": 5}, ["$.text"]),
    ({"text": "hi", "stream": "yes"}, ["$.stream"]),
    ({"text": "hi", "sampling_params": "greedy"}, ["$.sampling_params"]),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, ["max_new_tokens"]),
    ({"text": ""}, ["`text`", "empty"]),
    ({"input_ids": []}, ["`input_ids`", "empty"]),
    ({"text": ["ok", ""]}, ["`text[1]`", "empty"]),
    ({}, ["`text` or `input_ids`"]),
    ({"text": "a", "input_ids": [1]}, ["`text`", "`input_ids`"]),
    ({"input_ids": [1, 2, 10_000_000]}, ["`input_ids[2]`", "10000000", "vocabulary"]),
    ({"input_ids": [1, -1]}, ["`input_ids[1]`"]),
    ({"input_ids": [1, "x"]}, ["`input_ids[1]`"]),
    ({"input_ids": list(range(1, CONTEXT + 11))}, ["`input_ids`", str(CONTEXT + 10), str(CONTEXT)]),
    ({"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT}}, ["max_new_tokens", str(CONTEXT)]),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, ["max_new_tokens", "-1"]),
    ({"text": "hi", "sampling_params": {"foo": 1}}, ["foo"]),
    ({"text": "hi", "sampling_params": {"temperature": -0.5}}, ["temperature"]),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, ["top_p"]),
    ({"text": "hi", "sampling_params": {"top_p": 1.5}}, ["top_p"]),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, ["top_k"]),
    ({"text": "hi", "sampling_params": {"min_p": 2}}, ["min_p"]),
    ({"text": "hi", "sampling_params": {"stop": [""]}}, ["stop"]),
    ({"text": "hi", "sampling_params": {"regex": "(a"}}, ["`regex`", "cannot be compiled"]),
    ({"text": "hi", "sampling_params": {"json_schema": "{oops"}}, ["`json_schema`", "cannot be compiled"]),
    ({"text": "hi", "sampling_params": {"n": 2}, "stream": True, "image_data": "x"}, ["`image_data`"]),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, ["`sampling_params[1].n`"]),
    ({"text": ["a", "b"], "sampling_params": [{}]}, ["sampling_params", "1 entries", "batch of 2"]),
    ({"text": "a", "sampling_params": [{}]}, ["sampling_params"]),
    ({"text": "a", "top_logprobs_num": -1}, ["top_logprobs_num"]),
    ({"text": ["a", "b"], "rid": ["one"]}, ["`rid`", "1 entries", "batch of 2"]),
    ({"text": "a", "rid": ["one"]}, ["`rid`", "not a batch"]),
    ({"text": ["a", "b"], "rid": ["one", ""]}, ["`rid`", "non-empty"]),
    ({"text": "a", "bootstrap_host": ["127.0.0.1"]}, ["`bootstrap_host`", "not a batch"]),
    ({"text": ["a", "b"], "bootstrap_room": [1, 2, 3]}, ["`bootstrap_room`", "3 entries", "batch of 2"]),
    ({"text": ["a", "b"], "bootstrap_port": ["x", "y"]}, ["$.bootstrap_port"]),
])
def test_generate_bad_input(node, body, fields):
    post(node, "/generate", body, 400, *fields)


@pytest.mark.parametrize("body,fields", [
    ({"prompt": ""}, ["`prompt`", "empty"]),
    ({"prompt": []}, ["`prompt`"]),
    ({"model": "x"}, ["prompt"]),
    ({"prompt": "hi", "max_tokens": -1}, ["`max_tokens`", "-1"]),
    ({"prompt": "hi", "max_tokens": "many"}, ["$.max_tokens"]),
    ({"prompt": "hi", "max_tokens": CONTEXT}, ["`max_tokens`", str(CONTEXT)]),
    ({"prompt": [list(range(1, CONTEXT + 5))]}, ["`prompt[0]`", str(CONTEXT + 4)]),
    ({"prompt": "hi", "temperature": -1}, ["`temperature`"]),
    ({"prompt": "hi", "top_p": 2}, ["`top_p`"]),
    ({"prompt": "hi", "n": 0}, ["`n`"]),
    ({"prompt": "hi", "n": 65}, ["`n`", "64"]),
    ({"prompt": "hi", "n": 9}, ["`n`", "--max-queued-requests"]),
    ({"prompt": "hi", "logprobs": 99}, ["`logprobs`"]),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, ["min_tokens"]),
    ({"prompt": "hi", "logit_bias": {"1": 500}}, ["`logit_bias.1`", "[-100, 100]"]),
    ({"prompt": "hi", "logit_bias": {"one": 5}}, ["`logit_bias.one`", "token id"]),
    ({"prompt": "hi", "logit_bias": {"999999": 5}}, ["`logit_bias.999999`", "vocabulary"]),
    ({"prompt": "hi", "stop_regex": "("}, ["`stop_regex`", "regular expression"]),
    ({"prompt": "hi", "stop_regex": "a*"}, ["`stop_regex`", "empty string"]),
    ({"prompt": "hi", "regex": "a", "ebnf": "root ::= \"a\""}, ["`ebnf`", "`regex`"]),
    ({"prompt": "hi", "lora_path": "x"}, ["`lora_path`", "LoRA"]),
    ({"prompt": "hi", "nonsense": 1}, ["`nonsense`", "not a field"]),
    ({"prompt": "hi", "best_of": 2}, ["`best_of`"]),
    ({"prompt": "hi", "suffix": "x"}, ["suffix"]),
    ({"prompt": "hi", "stream_options": {"include_usage": "x"}}, ["stream_options.include_usage"]),
    ({"prompt": ["a", "b"], "rid": ["x"]}, ["`rid`", "1 entries", "batch of 2"]),
    ({"prompt": "a", "bootstrap_room": [1, 2]}, ["`bootstrap_room`", "not a batch"]),
    ({"prompt": ["a", "b"], "bootstrap_port": [1, 2, 3]}, ["`bootstrap_port`", "3 entries", "batch of 2"]),
])
def test_completions_bad_input(node, body, fields):
    post(node, "/v1/completions", body, 400, *fields)


@pytest.mark.parametrize("body,fields", [
    ({"messages": []}, ["`messages`", "empty"]),
    ({"messages": "hi"}, ["$.messages"]),
    ({"messages": [{"content": "hi"}]}, ["role"]),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, ["messages[0].role"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["messages[0].content[0]"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
     ["max_completion_tokens"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, ["`max_tokens`"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 * CONTEXT}, ["`max_tokens`"]),
    ({"messages": [{"role": "user", "content": "word " * CONTEXT}]}, ["`messages`", str(CONTEXT)]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, ["top_logprobs", "logprobs"]),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, ["$.temperature"]),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 3}, ["frequency_penalty"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, ["tools"]),
])
def test_chat_bad_input(node, body, fields):
    post(node, "/v1/chat/completions", body, 400, *fields)


def test_abort_request_bad_input(node):
    post(node, "/abort_request", {}, 400, "rid")
    post(node, "/abort_request", {"rid": 5}, 400, "$.rid")


def test_api_key(node):
    post(node, "/generate", {"text": "hi"}, 401, "API key", headers={})
    post(node, "/generate", {"text": "hi"}, 401, "API key", headers={"Authorization": "Bearer wrong"})
    code, _ = http_get(node.url + "/v1/models")
    assert code == 401
    code, _ = http_get(node.url + "/v1/models", headers=AUTH)
    assert code == 200
    assert http_get(node.url + "/health")[0] == 200  # health stays open
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=node.url + "/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=node.url + "/v1", api_key=KEY, max_retries=0).models.list()
    assert len(models.data) == 1


def test_unknown_route_and_wrong_method(node):
    code, raw = http_get(node.url + "/no/such/route", headers=AUTH)
    assert code == 404 and "/no/such/route" in json.loads(raw)["error"]["message"]
    code, raw = http_get(node.url + "/generate", headers=AUTH)
    assert code == 405 and "GET" in json.loads(raw)["error"]["message"]
    code, raw = http_post(node.url + "/v1/models", {}, headers=AUTH)
    assert code == 405


def test_duplicate_rid(node, control_dir):
    """A rid in use is refused (400 naming it) while its request runs; then the request is aborted. The
    forwards are slowed to 20 ms meanwhile, so the first request's 56 tokens run for a second or more on
    any host."""
    rid = "dup-rid"
    box = {}
    body = {"text": "long one", "rid": rid,
            "sampling_params": {"max_new_tokens": CONTEXT - 8, "ignore_eos": True}}
    with slow_forwards(control_dir, 0.02):
        t = threading.Thread(target=lambda: box.setdefault("r", http_post(node.url + "/generate", body,
                                                                           headers=AUTH)), daemon=True)
        t.start()
        deadline = time.time() + 60
        while json.loads(http_get(node.url + "/get_load", headers=AUTH)[1])[0]["num_reqs"] < 1:
            assert time.time() < deadline and "r" not in box, box  # until it is in the scheduler
            time.sleep(0.05)
        post(node, "/generate", {"text": "x", "rid": rid}, 400, "`rid`", rid)
        post(node, "/generate", {"text": ["x", "y"], "rid": ["a", "a"]}, 400, "`rid`")
        code, raw = http_post(node.url + "/abort_request", {"rid": rid}, headers=AUTH)
        assert code == 200 and json.loads(raw)["success"], raw
        t.join(60)
    code, raw = box["r"]
    assert code == 200, raw
    assert json.loads(raw)["meta_info"]["finish_reason"]["type"] == "abort", raw


def test_prefill_role_check():
    from common.config import ServerArgs
    from common.protocol import BadRequest
    from common.server.http import check_role

    check_role(ServerArgs(), None, None, None)  # a colocated node takes plain requests
    args = ServerArgs(disaggregation_mode="prefill")
    with pytest.raises(BadRequest, match="prefill node.*bootstrap_host/bootstrap_port/bootstrap_room"):
        check_role(args, None, None, None)
    with pytest.raises(BadRequest, match="bootstrap"):
        check_role(args, "127.0.0.1", 8998, None)
    check_role(args, "127.0.0.1", 8998, 42)
    # a decode node with --disaggregation-local-prefill takes a request with no rendezvous, not half of one
    local = ServerArgs(disaggregation_mode="decode", disaggregation_local_prefill=True)
    check_role(local, None, None, None)
    check_role(local, "127.0.0.1", 8998, 42)
    with pytest.raises(BadRequest, match="decode node.*bootstrap_host/bootstrap_port/bootstrap_room"):
        check_role(local, None, None, 42)
    with pytest.raises(BadRequest, match="decode node"):
        check_role(ServerArgs(disaggregation_mode="decode"), None, None, None)


def test_mixed_chunk_is_for_nodes_that_decode():
    from common.config import ServerArgs

    ServerArgs(enable_mixed_chunk=True).validate()
    ServerArgs(enable_mixed_chunk=True, disaggregation_mode="decode").validate()
    with pytest.raises(ValueError, match="enable-mixed-chunk.*prefill node"):
        ServerArgs(enable_mixed_chunk=True, disaggregation_mode="prefill").validate()
    with pytest.raises(ValueError, match="enable-mixed-chunk.*speculative"):
        ServerArgs(enable_mixed_chunk=True, speculative_algorithm="NGRAM").validate()


def test_local_prefill_is_a_decode_node_option():
    from common.config import ServerArgs

    for mode in ("null", "prefill"):
        with pytest.raises(ValueError, match="--disaggregation-local-prefill"):
            ServerArgs(disaggregation_mode=mode, disaggregation_local_prefill=True).validate()
    with pytest.raises(ValueError, match="needs --disaggregation-local-prefill"):
        ServerArgs(disaggregation_mode="decode", disaggregation_local_prefill_max_tokens=100).validate()
    with pytest.raises(ValueError, match="must be >= 1"):
        ServerArgs(disaggregation_mode="decode", disaggregation_local_prefill=True,
                   disaggregation_local_prefill_max_tokens=0).validate()
    ServerArgs(disaggregation_mode="decode", disaggregation_local_prefill=True,
               disaggregation_local_prefill_max_tokens=100).validate()


def test_item_fields_of_a_batch():
    from common.config import ServerArgs
    from common.protocol import BadRequest, CompletionRequest
    from common.server.http import item_fields

    decode = ServerArgs(disaggregation_mode="decode")
    # what a PD router sends: a list of rooms, shared host and port, one rid for the batch
    req = CompletionRequest(prompt=["a", "b"], rid="r", bootstrap_host="h",
                            bootstrap_port=1, bootstrap_room=[5, 6])
    assert item_fields(decode, req, 2, True) == [
        {"rid": "r-0", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5, "priority": 0,
         "data_parallel_rank": 0},
        {"rid": "r-1", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 6, "priority": 0,
         "data_parallel_rank": 0}]
    req.rid, req.bootstrap_host, req.bootstrap_port = ["x", "y"], ["h0", "h1"], [1, 2]
    assert [(f["rid"], f["bootstrap_host"], f["bootstrap_port"])
            for f in item_fields(decode, req, 2, True)] == [
                ("x", "h0", 1), ("y", "h1", 2)]
    req.bootstrap_room = 5  # one room cannot serve two transfers
    with pytest.raises(BadRequest, match="`bootstrap_room` must be a list"):
        item_fields(decode, req, 2, True)
    req.bootstrap_room = [5, None]
    with pytest.raises(BadRequest, match="decode node"):
        item_fields(decode, req, 2, True)
    # a batch with no rendezvous at all, on a decode node that prefills such requests itself
    local = ServerArgs(disaggregation_mode="decode", disaggregation_local_prefill=True)
    items = item_fields(local, CompletionRequest(prompt=["a", "b"], rid="r"), 2, True)
    assert [(f["rid"], f["bootstrap_room"], f["data_parallel_rank"]) for f in items] == [("r-0", None, None),
                                                                                          ("r-1", None, None)]
    # a colocated node ignores the rendezvous; without a rid each item gets its own
    plain = item_fields(ServerArgs(), CompletionRequest(prompt=["a", "b"]), 2, True)
    assert len({f["rid"] for f in plain}) == 2 and all(f["bootstrap_room"] is None for f in plain)
    # ... and a single room sent with a batch, which only a PD node refuses
    assert len(item_fields(ServerArgs(), CompletionRequest(prompt=["a", "b"],
                                                           bootstrap_room=5), 2, True)) == 2


def test_node_still_serves_after_bad_input(node):
    ok(node)
    code, raw = http_post(node.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, headers=AUTH)
    assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 2
    metrics = http_get(node.url + "/metrics", headers=AUTH)[1].decode()
    assert re.search(r'^pdserve_healthy\{model_name="[^"]*"\} 1\.0$', metrics, re.M)
    # the refused requests are counted by endpoint and status
    counted = [line for line in metrics.splitlines() if line.startswith("pdserve_requests_total{")]
    for endpoint, status in (("generate", 400), ("chat_completions", 400), ("generate", 200)):
        assert any(f'endpoint="{endpoint}"' in line and f'status="{status}"' in line for line in counted), \
            (endpoint, status, counted)


def test_scheduler_death_turns_health_503(node):
    # last test of the module: kill the scheduler process, the front end must notice
    import psutil

    children = psutil.Process(node.proc.pid).children(recursive=True)
    scheds = [c for c in children if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in
              " ".join(c.cmdline())]
    assert len(scheds) == 1, [c.cmdline() for c in children]
    scheds[0].send_signal(signal.SIGKILL)
    deadline = time.time() + 30
    while http_get(node.url + "/health")[0] != 503:
        assert time.time() < deadline, node.log_tail()
        time.sleep(0.1)
    post(node, "/generate", {"text": "hi"}, 503, "scheduler rank 0")
    assert "/health now answers 503" in node.log_text()
    assert node.stop() == 0
