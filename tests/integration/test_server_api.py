"""HTTP API of a real node (front end + scheduler process) serving the tiny random model on 127.0.0.1."""

from __future__ import annotations

import http.client
import itertools
import json
import re
import threading
import time

import psutil
import pytest

from tests.harness.client import http_get, http_post
from tests.harness.hooks import HOOKS, slow_forwards
from tests.harness.nodes import thread_names

openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1 2 3 4 5 6"]


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("node-hooks")


@pytest.fixture(scope="module")
def node(tiny_model_dir, module_launcher, control_dir):
    # a short context keeps the run-to-the-end tests (chat default max_tokens) quick; the test-only
    # hooks let the abort tests slow the forwards, so a request is still running when its abort lands
    return module_launcher.colocated(tiny_model_dir, max_total_tokens=4096, max_running_requests=8,
                                     served_model_name="tiny", context_length=160,
                                     env={"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(control_dir)})


@pytest.fixture(scope="module")
def tok(node):
    from transformers import AutoTokenizer

    info = get_json(node, "/model_info")
    return AutoTokenizer.from_pretrained(info["tokenizer_path"])


@pytest.fixture(scope="module")
def client(node):
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def get_json(node, path):
    status, body = http_get(node.url + path)
    assert status == 200, body
    return json.loads(body)


def generate(node, body, status=200):
    code, raw = http_post(node.url + "/generate", body)
    assert code == status, raw
    return json.loads(raw)


def greedy(max_new_tokens=8, **kw):
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **kw}


def sse_events(resp) -> list:
    """Parse an SSE body: the JSON events, then the literal "[DONE]"."""
    events = []
    for raw in resp:
        line = raw.decode().rstrip("\r\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_post(node, path, body) -> list:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    try:
        return sse_events(resp)
    finally:
        conn.close()


def stats(node) -> dict:
    return get_json(node, "/server_info")["stats"]


def wait_idle(node, timeout=60) -> dict:
    deadline = time.time() + timeout
    while True:
        s = stats(node)
        if s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0:
            return s
        assert time.time() < deadline, s
        time.sleep(0.1)


def free_counts(s: dict) -> tuple[int, int]:
    # tokens held only by the radix cache are free for the taking: count them as free
    return s["kv_free_tokens"] + s["kv_evictable_tokens"], s["req_slots_free"]


# ---------------------------------------------------------------------------------------------- the process
def test_a_single_rank_joins_no_gloo_group(node):
    """One rank has nobody to reduce with; gloo's loop threads kept an idle node at ~1.2 % of a core."""
    children = psutil.Process(node.proc.pid).children(recursive=True)
    ranks = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(ranks) == 1, [c.cmdline() for c in children]
    names = thread_names(ranks[0].pid)
    assert names and "gloo_tcp_loop" not in names, names


# ---------------------------------------------------------------------------------------------- /generate
def test_generate_single_shape(node, tok):
    out = generate(node, {"text": PROMPTS[0], "sampling_params": greedy(6)})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
            "e2e_latency"} <= set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["prompt_tokens"] == len(tok.encode(PROMPTS[0]))
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    assert isinstance(meta["id"], str) and meta["id"]
    # the same prompt as token ids, with a client rid
    again = generate(node,
                     {"input_ids": tok.encode(PROMPTS[0]), "sampling_params": greedy(6), "rid": "my-rid-1"})
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["id"] == "my-rid-1"


def test_generate_batch_matches_single(node, tok):
    singles = [generate(node, {"text": p, "sampling_params": greedy(5)}) for p in PROMPTS]
    batch = generate(node, {"text": PROMPTS, "sampling_params": greedy(5)})
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    for s, b in zip(singles, batch, strict=True):
        assert b["output_ids"] == s["output_ids"]
        assert b["text"] == s["text"]
    # input_ids batch with per-item sampling params
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    out = generate(node, {"input_ids": ids, "sampling_params": [greedy(3), greedy(4)]})
    assert [len(o["output_ids"]) for o in out] == [3, 4]
    assert out[0]["output_ids"] == singles[0]["output_ids"][:3]
    assert len({o["meta_info"]["id"] for o in out}) == 2
    # one rid for a batch: one per item, derived from it
    out = generate(node, {"input_ids": ids, "sampling_params": greedy(1), "rid": "batch-rid"})
    assert [o["meta_info"]["id"] for o in out] == ["batch-rid-0", "batch-rid-1"]


def test_generate_stream(node):
    full = generate(node, {"text": PROMPTS[1], "sampling_params": greedy(8)})
    events = stream_post(node, "/generate",
                         {"text": PROMPTS[1], "sampling_params": greedy(8), "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    for a, b in zip(texts, texts[1:], strict=False):
        assert b.startswith(a)  # cumulative text, as SGLang streams it
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]


def test_generate_stream_batch_has_index(node):
    events = stream_post(node, "/generate",
                         {"text": PROMPTS[:2], "sampling_params": greedy(3), "stream": True})
    assert events[-1] == "[DONE]"
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1}
    assert all(len(c["output_ids"]) == 3 for c in finals.values())


def test_generate_logprobs(node, tok):
    ids = tok.encode(PROMPTS[0])
    out = generate(node, {"input_ids": ids, "sampling_params": greedy(4), "return_logprob": True,
                          "top_logprobs_num": 3, "logprob_start_len": 0, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    otl = meta["output_token_logprobs"]
    assert [e[1] for e in otl] == out["output_ids"]
    for lp, tid, text in otl:
        assert lp <= 0.0 and text == tok.decode([tid])
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4
    for row, chosen in zip(tops, otl, strict=True):
        assert len(row) == 3
        assert row[0][1] == chosen[1]  # greedy picks the most likely token
        assert abs(row[0][0] - chosen[0]) < 1e-4
        assert [r[0] for r in row] == sorted((r[0] for r in row), reverse=True)
    itl = meta["input_token_logprobs"]
    assert len(itl) >= len(ids) - 1
    assert [e[1] for e in itl] == ids[len(ids) - len(itl):]
    assert "input_top_logprobs" in meta
    # without text
    out = generate(node, {"input_ids": ids, "sampling_params": greedy(2), "return_logprob": True})
    assert all(e[2] is None for e in out["meta_info"]["output_token_logprobs"])
    assert "output_top_logprobs" not in out["meta_info"]


def test_generate_stop_string_trimmed(node):
    base = generate(node, {"text": PROMPTS[1], "sampling_params": greedy(12)})
    text = base["text"]
    # a stop string from the middle of the greedy output
    words = [w for w in re.findall(r"\S+", text[len(text) // 3:]) if w]
    if not words:
        pytest.skip("the random model produced no word to stop on")
    stop = words[0]
    cut = text.find(stop)
    out = generate(node, {"text": PROMPTS[1], "sampling_params": greedy(12, stop=stop)})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:cut]
    kept = generate(node, {"text": PROMPTS[1], "sampling_params": greedy(12, stop=stop, no_stop_trim=True)})
    assert kept["text"].startswith(text[:cut] + stop)


# ---------------------------------------------------------------------------------------------- OpenAI
def test_completions_openai_client(node, client):
    ref = generate(node, {"text": PROMPTS[0], "sampling_params": greedy(7)})
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    # default max_tokens is OpenAI's 16
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    # batch of prompts -> one choice each
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == generate(node, {"text": PROMPTS[0], "sampling_params": greedy(3)})["text"]


def test_completions_stream_openai_client(node, client):
    ref = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completions_logprobs_and_echo(node, client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    c = r.choices[0]
    n_prompt = r.usage.prompt_tokens
    assert c.text.startswith(PROMPTS[0])
    # echo: the prompt's tokens first, the first one's logprob null (OpenAI's shape), then the 3 output tokens
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == n_prompt + 3
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in c.logprobs.token_logprobs[1:])
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])
    assert c.text[len(PROMPTS[0]):] == "".join(c.logprobs.tokens[n_prompt:])
    assert c.logprobs.text_offset[n_prompt] == len(PROMPTS[0])


def test_chat_openai_client(node, client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_default_max_tokens_is_context_room(node, client):
    # no max_tokens: the chat default is the rest of the context
    r = client.chat.completions.create(model="tiny",
                                       messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       extra_body={"ignore_eos": True})
    ctx = get_json(node, "/model_info")["context_length"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == ctx


def test_chat_stop_seed_logprobs(node, client):
    msgs = [{"role": "user", "content": "Count please"}]
    sampled = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=1.0,
                                              seed=1234, extra_body={"ignore_eos": True})
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]
    base = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    words = re.findall(r"\S+", base[len(base) // 3:])
    if words:
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                           stop=[words[0]], extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == base[:base.find(words[0])]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3,
                                       temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token


# --------------------------------------------------------------------------------------------- info endpoints
def test_info_endpoints(node, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body = http_get(node.url + "/health")
    assert status == 200
    assert http_get(node.url + "/health_generate")[0] == 200
    info = get_json(node, "/server_info")
    assert info["disaggregation_mode"] == "null" and info["version"]
    assert {"disaggregation_bootstrap_port", "page_size", "max_total_tokens", "stats", "tp"} <= set(info)
    assert get_json(node, "/get_server_info")["port"] == node.port
    s = info["stats"]
    for k in ("num_running_reqs", "num_waiting_reqs", "kv_free_tokens",
              "kv_total_tokens", "kv_evictable_tokens", "req_slots_free", "req_slots_total"):
        assert isinstance(s[k], (int, float)), k
    mi = get_json(node, "/model_info")
    assert mi["is_generation"] is True and mi["served_model_name"] == "tiny"
    assert mi["model_path"] and mi["tokenizer_path"]
    assert get_json(node, "/get_model_info") == mi
    load = get_json(node, "/get_load")
    assert isinstance(load, list) and set(load[0]) == {"dp_rank", "num_reqs",
                                                       "num_waiting_reqs", "num_tokens",
                                                        "num_queued_reqs", "max_queued_requests",
                                                        "kv_available_tokens"}
    code, body = http_post(node.url + "/flush_cache", b"")
    assert code == 200, body


def test_version_endpoint(node):
    from importlib.metadata import version

    assert get_json(node, "/version") == {"version": version("pdserve")}
    assert get_json(node, "/server_info")["version"] == version("pdserve")


def test_metrics_parse(node):
    from prometheus_client.parser import text_string_to_metric_families

    generate(node, {"text": PROMPTS[0], "sampling_params": greedy(3)})
    status, body = http_get(node.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    # every series names the served model, as SGLang's do
    assert all(s.labels.get("model_name") == "tiny" for f in families.values() for s in f.samples)

    def value(family, suffix="", **labels):
        return sum(s.value for s in families[family].samples
                   if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    assert families["sglang:prompt_tokens"].type == "counter" and value("sglang:prompt_tokens", "_total") >= 1
    assert value("sglang:generation_tokens", "_total") >= 3
    assert families["pdserve_requests"].type == "counter"
    assert value("pdserve_requests", "_total", endpoint="generate", status="200") >= 1
    for h in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
              "sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds",
              "pdserve_queue_time_seconds"):
        assert families[h].type == "histogram", h
    assert value("sglang:e2e_request_latency_seconds", "_count") >= 1
    assert value("sglang:time_to_first_token_seconds", "_bucket", le="+Inf") >= 1
    assert value("pdserve_queue_time_seconds", "_count") >= 1
    for g in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
              "sglang:cache_hit_rate",
              "sglang:gen_throughput", "pdserve_kv_free_tokens", "pdserve_queue_reqs"):
        assert families[g].type == "gauge", g
    assert families["pdserve_num_retractions"].type == "counter"
    assert value("pdserve_healthy") == 1


# ---------------------------------------------------------------------------------------------- aborts
def _run_in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    return t, box


def _wait_running(node, n=1, timeout=60):
    deadline = time.time() + timeout
    while get_json(node, "/get_load")[0]["num_reqs"] < n:
        assert time.time() < deadline, "request never started"
        time.sleep(0.05)


_ABORT_RIDS = itertools.count()
SLOW_FORWARD = 0.02  # seconds: a request of the tiny context (~150 tokens) runs for 3 s or more


def _abort_running(node, control_dir, n: int, abort) -> list[dict]:
    """Start `n` requests as long as the tiny model's context allows, with the forwards slowed so they
    run for seconds on any host, wait until they run, then post `abort(rids)` (the body, given the
    requests' rids): every request ends aborted, early. Returns the requests' results."""
    ctx = get_json(node, "/model_info")["context_length"]
    rids = [f"abort-{next(_ABORT_RIDS)}" for _ in range(n)]
    bodies = [{"text": f"abort me {rid}", "rid": rid, "sampling_params": greedy(ctx - 8)} for rid in rids]
    with slow_forwards(control_dir, SLOW_FORWARD):
        threads = [_run_in_thread(lambda b=b: generate(node, b)) for b in bodies]
        _wait_running(node, n)
        code, raw = http_post(node.url + "/abort_request", abort(rids))
        for t, _ in threads:
            t.join(60)
    assert code == 200, raw
    outs = [box["out"] for _, box in threads]
    assert json.loads(raw) == {"success": True, "aborted": n}, (raw, outs)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs), outs
    assert all(o["meta_info"]["completion_tokens"] < ctx - 8 for o in outs), outs
    return outs


def test_abort_request(node, control_dir):
    start = free_counts(wait_idle(node))
    ctx = get_json(node, "/model_info")["context_length"]
    _abort_running(node, control_dir, 1, lambda rids: {"rid": rids[0]})
    assert free_counts(wait_idle(node)) == start
    # abort_all
    _abort_running(node, control_dir, 2, lambda rids: {"abort_all": True})
    assert free_counts(wait_idle(node)) == start
    # unknown rid: nothing to abort, still a valid call
    code, raw = http_post(node.url + "/abort_request", {"rid": "no-such-rid"})
    assert code == 200 and json.loads(raw)["success"] is False
    # ... and the request, when it arrives after its abort (a router abandoned the leg while the request
    # was still on its way), ends at once instead of running or waiting for its peer
    before = get_json(node, "/server_info")["num_early_aborts"]
    out = generate(node, {"text": "late", "rid": "no-such-rid", "sampling_params": greedy(ctx - 8)})
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] == 0
    assert get_json(node, "/server_info")["num_early_aborts"] == before + 1
    out = generate(node, {"text": "again", "rid": "no-such-rid", "sampling_params": greedy(4)})
    assert out["meta_info"]["completion_tokens"] == 4  # the abort was used once
    assert free_counts(wait_idle(node)) == start


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees(node, control_dir, stream):
    start = free_counts(wait_idle(node))
    ctx = get_json(node, "/model_info")["context_length"]
    rid = f"disconnect-{stream}"
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    with slow_forwards(control_dir, SLOW_FORWARD):  # still running when the client goes
        conn.request("POST", "/generate", json.dumps({"text": "go on forever", "rid": rid, "stream": stream,
                                                      "sampling_params": greedy(ctx - 8)}),
                     {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            for _ in range(2):  # two chunks: the request is running
                line = resp.readline()
                while line in (b"\n", b"\r\n"):
                    line = resp.readline()
                assert line.startswith(b"data: ")
        else:
            _wait_running(node)
        conn.sock.close()  # the client goes away mid-request
        conn.close()
    after = wait_idle(node)
    assert free_counts(after) == start
    deadline = time.time() + 10
    while f"rid={rid} endpoint=generate status=499" not in node.log_text():
        assert time.time() < deadline, node.log_tail()
        time.sleep(0.1)
    # the scheduler got the abort (its own log line for the rid mentions it)
    assert any("scheduler" in line and f"rid={rid}" in line and "abort" in line
               for line in node.log_text().splitlines()), node.log_tail()


def test_sigterm_exits_cleanly(node):
    # last test of the module: stop the shared node and check the exit
    out = generate(node, {"text": "bye", "sampling_params": greedy(2)})
    assert out["meta_info"]["completion_tokens"] == 2
    assert node.stop() == 0
    assert "stopped" in node.log_text()

