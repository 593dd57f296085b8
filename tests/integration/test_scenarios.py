"""Client-facing scenarios through the router of a real cluster (2 prefill + 2 decode, fake transfer
backend, tiny random model). Every test ends with every node's pools back at their starting figures
(the `pools_restored` fixture)."""

from __future__ import annotations

import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.client import error_message, http_json, metric_total, stream
from tests.harness.cluster import CHUNK, PAGE_SIZE, node_stats, wait_pools

openai = pytest.importorskip("openai")


def greedy(n: int, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def client(fake_cluster):
    return openai.OpenAI(base_url=fake_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(fake_cluster):
    status, body = http_json("GET", fake_cluster.url + "/v1/models")
    assert status == 200, body
    return body["data"][0]["id"]


def test_generate_plain_batch_and_stream(pools_restored):
    url = pools_restored.url + "/generate"
    status, out = http_json("POST", url, {"text": "The capital of France is", "sampling_params": greedy(8)})
    assert status == 200, out
    assert len(out["output_ids"]) == 8 and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 8 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] == "length"

    status, outs = http_json("POST", url,
                             {"text": ["one two three", "four five"], "sampling_params": greedy(5)})
    assert status == 200, outs
    assert isinstance(outs, list) and len(outs) == 2
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5, 5]

    res = stream(url, {"input_ids": list(range(100, 140)), "sampling_params": greedy(12), "stream": True})
    assert res.ok, res.error
    last = res.events[-1]
    assert last["meta_info"]["completion_tokens"] == 12 and last["meta_info"]["prompt_tokens"] == 40
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(res.events) >= 2  # streamed, not one final blob


def test_openai_completions(pools_restored, client, model_name):
    out = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens > 0
    assert isinstance(out.choices[0].text, str)

    chunks = list(client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 10


def test_openai_chat_completions(pools_restored, client, model_name):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 9

    chunks = list(client.chat.completions.create(model=model_name, messages=msgs, max_tokens=9, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    # (the fake backend moves no KV bytes, so the text itself is arbitrary and may be empty)
    assert len([c for c in chunks if c.choices]) >= 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert [c.usage for c in chunks if c.usage][-1].completion_tokens == 9


def test_64_concurrent_requests_spread_over_both_pools(pools_restored):
    cluster = pools_restored
    before = {c.name: node_stats(c.url)["total_generated_tokens"] for c in cluster.decodes}
    rng = random.Random(7)
    bodies = [{"input_ids": [rng.randrange(200, 20000) for _ in range(rng.randint(4, 60))],
               "sampling_params": greedy(rng.randint(4, 12))} for _ in range(64)]

    def one(body):
        return http_json("POST", cluster.url + "/generate", body, timeout=300)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, bodies))
    for body, (status, out) in zip(bodies, results, strict=True):
        assert status == 200, out
        assert out["meta_info"]["completion_tokens"] == body["sampling_params"]["max_new_tokens"]
        assert out["meta_info"]["prompt_tokens"] == len(body["input_ids"])
    assert len({out["meta_info"]["id"] for _, out in results}) == 64
    after = {c.name: node_stats(c.url)["total_generated_tokens"] for c in cluster.decodes}
    assert all(after[n] > before[n] for n in before), (before, after)  # round robin used both decode nodes


@pytest.mark.parametrize("stream_mode", [False, True])
def test_mixed_prompt_lengths_across_chunk_boundaries(pools_restored, stream_mode):
    lengths = [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK,
               2 * CHUNK + PAGE_SIZE + 3, 7 * CHUNK + 5, 300]
    rng = random.Random(len(lengths) + stream_mode)
    url = pools_restored.url + "/generate"

    def one(n):
        body = {"input_ids": [rng.randrange(200, 20000) for _ in range(n)], "sampling_params": greedy(6),
                "stream": stream_mode}
        if stream_mode:
            res = stream(url, body)
            assert res.ok, res.error
            return res.events[-1]
        status, out = http_json("POST", url, body)
        assert status == 200, out
        return out

    with ThreadPoolExecutor(len(lengths)) as pool:
        outs = list(pool.map(one, lengths))
    for n, out in zip(lengths, outs, strict=True):
        assert out["meta_info"]["prompt_tokens"] == n
        assert out["meta_info"]["completion_tokens"] == 6
        assert len(out["output_ids"]) == 6


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_client_disconnect_mid_stream_frees_everything(pools_restored, path):
    cluster = pools_restored
    aborted_before = sum(metric_total(c.url, "pdserve_aborted_requests_total") for c in cluster.decodes)
    if path == "/generate":
        body = {"text": "tell me a long story", "sampling_params": greedy(1500), "stream": True}
    else:
        body = {"prompt": "tell me a long story", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                "stream": True}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: stream(cluster.url + path, dict(body), stop_after=3), range(4)))
    for r in results:
        assert r.status == 200 and len(r.events) == 3 and not r.done, r.error
    # the decode nodes saw the clients go away and aborted those requests (pools: the fixture)
    wait_pools(cluster, cluster.baseline)
    aborted_after = sum(metric_total(c.url, "pdserve_aborted_requests_total") for c in cluster.decodes)
    assert aborted_after - aborted_before >= 4


@pytest.mark.parametrize("path,body,field", [
    ("/generate", b"{not json", "json"),
    ("/generate", {"sampling_params": {"max_new_tokens": 4}}, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", [1, 2, 3], "object"),
])
def test_malformed_requests_get_400_and_cluster_keeps_serving(pools_restored, path, body, field):
    status, out = http_json("POST", pools_restored.url + path, body)
    assert status == 400, (status, out)
    assert field.lower() in error_message(out).lower(), out
    status, out = http_json("POST", pools_restored.url + "/generate",
                            {"text": "still alive?", "sampling_params": greedy(3)})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3, out


def test_prompt_longer_than_context_is_refused(pools_restored):
    status, info = http_json("GET", pools_restored.url + "/model_info")
    ctx = info.get("context_length") or 2048
    status, out = http_json("POST", pools_restored.url + "/generate",
                            {"input_ids": [300] * (ctx + 10), "sampling_params": greedy(4)})
    assert status == 400, (status, out)
    msg = error_message(out).lower()
    assert "context" in msg or "too long" in msg or "length" in msg, out


def test_router_logs_the_client_request_id(pools_restored):
    rid = "itest-" + uuid.uuid4().hex[:8]
    status, out = http_json("POST", pools_restored.url + "/generate",
                            {"text": "hello", "sampling_params": greedy(2)}, headers={"X-Request-ID": rid})
    assert status == 200, out
    with open(pools_restored.router.log_path, encoding="utf-8", errors="replace") as f:
        assert any(f"rid={rid} " in line and "status=200" in line for line in f)
