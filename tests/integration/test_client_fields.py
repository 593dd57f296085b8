"""What common clients send and read, on a colocated node and through the router of a PD cluster whose
backend moves the KV (mooncake over TCP), serving the tiny random model:

* `/v1/completions` with `echo` and `logprobs`: the prompt's logprobs (the first one null) and top
  logprobs equal transformers' own log-softmax of the same weights; `max_tokens: 0` scores the prompt
  alone; streamed equals whole; across PD the router joins the prefill node's prompt part and the
  decode node's output part;
* `stream_options`: `include_usage` and `continuous_usage_stats`;
* model names: `/v1/models` and `/v1/models/{id}` give the served name, another name is a 404
  `model_not_found`; endpoints this server does not serve answer a JSON 404 that says so;
* the bodies real clients send with fields at their defaults (SGLang's bench_serving, vLLM's) are
  served, and `priority` is taken by a default (FCFS) node;
* `reasoning_effort` and `documents` reach a chat template that reads them, and are refused by one
  that does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.client import http_json, stream
from tests.harness.cluster import MODEL, NODE_SETTINGS

PROMPTS = ["The capital of France is", "One, two, three, four"]
TEMPLATE = str(Path(__file__).resolve().parent.parent / "data" / "reasoning_effort.jinja")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """transformers' log-softmax over the prompts, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        out[p] = (ids, torch.log_softmax(logits, dim=-1))
    return out


def completions(url: str, **body) -> dict:
    status, out = http_json("POST", url + "/v1/completions", {"model": MODEL, **body})
    assert status == 200, out
    return out


def test_echo_logprobs_are_transformers_log_softmax(colocated, mooncake_pd, reference):
    for url in (colocated.url, mooncake_pd.url):
        out = completions(url, prompt=PROMPTS, max_tokens=2, temperature=0, echo=True, logprobs=2)
        for choice, p in zip(out["choices"], PROMPTS, strict=True):
            ids, logp = reference[p]
            lp = choice["logprobs"]
            n = len(ids)
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 2
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want = [logp[k - 1, ids[k]].item() for k in range(1, n)]
            assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-4), url
            for k in range(1, n):  # the top entries of every prompt position
                top = sorted(lp["top_logprobs"][k].values(), reverse=True)
                assert top == pytest.approx(torch.topk(logp[k - 1], 2).values.tolist(), abs=1e-4)
            # the first output token is greedy after the prompt: its logprob is the last row's max
            assert lp["token_logprobs"][n] == pytest.approx(logp[n - 1].max().item(), abs=1e-4)
            assert choice["text"].startswith(p) and lp["text_offset"][n] == len(p)


def test_max_tokens_zero_scores_the_prompt(colocated, mooncake_pd, reference):
    for url in (colocated.url, mooncake_pd.url):
        out = completions(url, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
        choice = out["choices"][0]
        ids, logp = reference[PROMPTS[0]]
        assert choice["text"] == PROMPTS[0] and out["usage"]["completion_tokens"] == 0, url
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            [logp[k - 1, ids[k]].item() for k in range(1, len(ids))], abs=1e-4)


def test_streamed_echo_logprobs_equal_the_whole_answer(colocated, mooncake_pd):
    for url in (colocated.url, mooncake_pd.url):
        whole = completions(url, prompt=PROMPTS, max_tokens=3, temperature=0, echo=True, logprobs=1)
        res = stream(url + "/v1/completions",
                     {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "temperature": 0,
                      "echo": True, "logprobs": 1, "stream": True})
        assert res.ok, res.error
        for i, choice in enumerate(whole["choices"]):
            parts = [c for e in res.events for c in e["choices"] if c["index"] == i]
            assert "".join(c["text"] for c in parts) == choice["text"]
            tokens = [t for c in parts for t in c["logprobs"]["tokens"]]
            lps = [x for c in parts for x in c["logprobs"]["token_logprobs"]]
            assert tokens == choice["logprobs"]["tokens"] and lps == choice["logprobs"]["token_logprobs"], url


def test_stream_usage_options(colocated, mooncake_pd):
    msgs = [{"role": "user", "content": "Count to five."}]
    for url in (colocated.url, mooncake_pd.url):
        base = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "stream": True}
        res = stream(url + "/v1/chat/completions", {**base, "stream_options": {"include_usage": True}})
        assert res.ok, res.error
        assert all(e["usage"] is None for e in res.events[:-1]) and res.events[-1]["choices"] == []
        assert res.events[-1]["usage"]["completion_tokens"] == 5
        res = stream(url + "/v1/chat/completions",
                     {**base, "stream_options": {"continuous_usage_stats": True}})
        assert res.ok, res.error
        counts = [e["usage"]["completion_tokens"] for e in res.events]
        assert counts == sorted(counts) and counts[-1] == 5, counts
        assert all(e["usage"]["prompt_tokens"] > 0 for e in res.events[1:]), res.events
        status, err = http_json("POST", url + "/v1/chat/completions",
                                {**base, "stream_options": {"bogus": True}})
        assert status == 400 and err["error"]["param"] == "stream_options.bogus", err


def test_model_names_and_unserved_endpoints(colocated, mooncake_pd):
    for url in (colocated.url, mooncake_pd.url):
        status, models = http_json("GET", url + "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [MODEL], models
        status, card = http_json("GET", url + f"/v1/models/{MODEL}")
        assert status == 200 and card["id"] == MODEL, card
        for method, path, body in (("GET", "/v1/models/gpt-4o", None),
                                   ("POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": [
                                       {"role": "user", "content": "hi"}]}),
                                   ("POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"})):
            status, err = http_json(method, url + path, body)
            assert status == 404 and err["error"]["code"] == "model_not_found", (url, path, err)
            assert "`gpt-4o`" in err["error"]["message"] and MODEL in err["error"]["message"]
        for path in ("/v1/embeddings", "/v1/responses"):
            status, err = http_json("POST", url + path, {"model": MODEL, "input": "hi"})
            assert status == 404 and err["error"]["code"] == "unsupported_endpoint", (url, path, err)
            assert "not served here" in err["error"]["message"]


def test_client_defaults_and_priority_are_served(colocated, mooncake_pd):
    """The fields SGLang's bench_serving and vLLM's clients send on every request, at their defaults."""
    for url in (colocated.url, mooncake_pd.url):
        status, out = http_json("POST", url + "/generate", {
            "text": PROMPTS[0],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True,
                                "sampling_seed": None, "custom_params": None},
            "stream": False, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1, "priority": 5})
        assert status == 200 and out["meta_info"]["completion_tokens"] == 3, out
        out = completions(url, prompt=PROMPTS[0], best_of=1, max_tokens=3, temperature=0.0, ignore_eos=True,
                          stream=False, priority=-2, include_stop_str_in_output=False, length_penalty=1.0)
        assert out["usage"]["completion_tokens"] == 3
        status, out = http_json("POST", url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "store": True,
            "metadata": {"run": "1"}, "service_tier": "auto", "user": "u1", "prompt_cache_key": "k"})
        assert status == 200, out
        status, err = http_json("POST", url + "/v1/completions",
                                {"model": MODEL, "prompt": "hi", "best_of": 2})
        assert status == 400 and err["error"]["code"] == "unsupported_value" \
            and "`best_of`" in err["error"]["message"]


def test_template_fields_reach_a_template_that_reads_them(colocated, tiny_model_dir, module_launcher):
    reader = module_launcher.colocated(tiny_model_dir, **{**NODE_SETTINGS, "chat_template": TEMPLATE})
    msgs = [{"role": "user", "content": "hi"}]

    def chat(url, **extra):
        return http_json("POST", url + "/v1/chat/completions",
                         {"model": MODEL, "messages": msgs, "max_tokens": 4,
                            "temperature": 0, **extra})

    plain = chat(reader.url)[1]
    low = chat(reader.url, reasoning_effort="low")[1]
    assert low["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    same = chat(reader.url, chat_template_kwargs={"reasoning_effort": "low"})[1]
    assert same["usage"]["prompt_tokens"] == low["usage"]["prompt_tokens"]
    assert same["choices"][0]["message"] == low["choices"][0]["message"]
    docs = chat(reader.url, documents=[{"title": "Paris", "text": "the capital of France"}])[1]
    assert docs["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    status, err = chat(reader.url, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert status == 400 and "reasoning_effort" in err["error"]["message"]
    for field, value in (("reasoning_effort", "low"), ("documents", [{"title": "t", "text": "x"}])):
        status, err = chat(colocated.url, **{field: value})  # its template reads neither
        assert status == 400 and err["error"]["param"] == field \
            and "does not read it" in err["error"]["message"]


def test_vllm_extensions(colocated, mooncake_pd):
    """vLLM's own fields: prompt truncation, tokens named by id, `structured_outputs`, `top_k` 0."""
    for url in (colocated.url, mooncake_pd.url):
        full = completions(url, prompt=PROMPTS[1], max_tokens=1, temperature=0)["usage"]["prompt_tokens"]
        for side in ("left", "right"):
            out = completions(url, prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True, logprobs=0,
                              truncate_prompt_tokens=2, truncation_side=side)
            assert out["usage"]["prompt_tokens"] == 2 < full, out
        out = completions(url, prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=1,
                          return_tokens_as_token_ids=True)
        tokens = out["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 2 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens), tokens
        for so, allowed in (({"choice": ["yes", "no"]}, {"yes", "no"}), ({"regex": "[ab]{3}"}, None)):
            out = completions(url, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=3, top_k=0,
                              structured_outputs=so)
            text = out["choices"][0]["text"]
            assert text in allowed if allowed else len(text) == 3 and set(text) <= {"a", "b"}, (so, text)
        status, err = http_json("POST", url + "/v1/completions", {"model": MODEL, "prompt": "x", "regex": "a",
                                                                   "structured_outputs": {"regex": "b"}})
        assert status == 400 \
            and "`structured_outputs` cannot be combined with `regex`" in err["error"]["message"]
