"""The API surface users of SGLang and vLLM expect, through the official OpenAI SDK and SGLang's native
API, on a colocated node and through the router of a PD cluster whose backend moves the KV (mooncake over
TCP), serving the tiny random model:

* structured output (`response_format` json_object / json_schema, SGLang's regex / ebnf): every answer
  parses and validates, whatever the random weights, greedy and sampled; disaggregated answers equal
  colocated ones token for token (the prefill node samples the first token under the grammar, the decode
  node's matcher starts from it);
* `n` > 1 (one room per copy across PD, the prompt prefilled once on a node), `logit_bias`, `stop_regex`;
* tools: `required` and a named function force valid calls (plain and streamed), `none` shows no tools;
* `/tokenize`, `/detokenize`; X-Request-ID as the rid of every process's log lines; strict fields.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.harness.client import http_json, stream
from tests.harness.cluster import MODEL

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "unit": {"type": "string", "enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}}}
ASK = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def node(colocated):
    return colocated


@pytest.fixture(scope="module")
def cluster(mooncake_pd):
    return mooncake_pd


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def both(node, cluster):
    return [("colocated", client(node.url)), ("pd", client(cluster.url))]


# ------------------------------------------------------------------------------------------ structured output
def test_json_schema_answers_validate_colocated_and_pd_alike(node, cluster):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = {}
    for where, c in both(node, cluster):
        for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 1.3, "top_p": 0.9}):
            out = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64,
                                            response_format=fmt, **kw)
            choice = out.choices[0]
            assert choice.finish_reason == "stop", (where, kw, choice)
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            if "top_p" not in kw:
                texts.setdefault(json.dumps(kw), []).append(choice.message.content)
    for kw, (colocated, pd) in texts.items():
        assert colocated == pd, kw  # the decode node continues exactly where the grammar stood


def test_json_object_streamed_through_the_router(cluster):
    chunks = client(cluster.url).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=96, temperature=0, stream=True,
        response_format={"type": "json_object"},
        extra_body={"logit_bias": {"13": 5}})  # pushes towards "," so the object has members
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict), text


def test_native_regex_and_ebnf(node, cluster):
    cases = [({"regex": r"(yes|no), [0-9]{2} items"}, re.compile(r"(yes|no), [0-9]{2} items")),
             ({"ebnf": 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'},
              re.compile(r"The answer is [0-9]{2}\."))]
    for url in (node.url, cluster.url):
        for params, pattern in cases:
            for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
                status, out = http_json("POST", url + "/generate", {
                    "text": "Say it:", "sampling_params": {"max_new_tokens": 40, **params, **sampling}})
                assert status == 200, out
                assert pattern.fullmatch(out["text"]), (params, out["text"])
                assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_bad_grammars_are_400s_before_a_stream_starts(node, cluster):
    for url in (node.url, cluster.url):
        res = stream(url + "/generate", {"text": "x", "stream": True,
                                         "sampling_params": {"json_schema": '{"type": "object", '
                                                                            '"properties": 5}'}})
        assert res.status == 400 and "json_schema" in res.error, res
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model=MODEL, messages=ASK,
                                                response_format={"type": "json_schema"})
        assert "json_schema" in str(e.value)


# ---------------------------------------------------------------------------------- n, logit_bias, stop_regex
def test_n_copies_share_the_prompt_and_match_across_pd(node, cluster):
    prompt = "Numbers: " + " ".join(str(i) for i in range(40))
    length = http_json("POST", node.url + "/tokenize", {"prompt": prompt})[1]["count"]
    before = http_json("GET", node.url + "/server_info")[1]["stats"]["total_prefill_tokens"]
    outs = {}
    for where, c in both(node, cluster):
        out = c.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=11,
                                   extra_body={"ignore_eos": True})
        assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
        assert len({ch.text for ch in out.choices}) > 1  # copy j draws with seed + j
        # the prompt counts once
        assert out.usage.completion_tokens == 32 and out.usage.prompt_tokens == length
        outs[where] = [ch.text for ch in out.choices]
    assert outs["colocated"] == outs["pd"]  # one room per copy, each copy continued exactly
    used = http_json("GET", node.url + "/server_info")[1]["stats"]["total_prefill_tokens"] - before
    assert used < 2 * length, used  # the copies took the prompt's KV from the cache

    chat = client(cluster.url).chat.completions.create(model=MODEL, messages=ASK, n=3,
                                                       max_tokens=5, stream=True, temperature=1.0, seed=5)
    texts = [""] * 3
    for ch in chat:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts)


def test_logit_bias_and_stop_regex(node, cluster):
    for _, c in both(node, cluster):
        forced = c.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                      logit_bias={"330": 100},
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})
        ids = c.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=1,
                                   logit_bias={"330": 100}, extra_body={"ignore_eos": True})
        assert forced.choices[0].text == ids.choices[0].text and len(ids.choices[0].logprobs.tokens) == 6
        assert len(set(ids.choices[0].logprobs.tokens)) == 1  # every token is 330

        free = c.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
        piece = free[len(free) // 2:len(free) // 2 + 2]
        cut = c.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "stop_regex": re.escape(piece)}).choices[0]
        assert cut.finish_reason == "stop" and free.startswith(cut.text) \
            and piece not in cut.text, (free, cut)


# ---------------------------------------------------------------------------------------------- tools
def test_tool_choice_required_and_named_give_valid_calls(node, cluster):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for _, c in both(node, cluster):
        for choice, names in (("required", set(schemas)),
                              ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
            for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 2}):
                out = c.chat.completions.create(model=MODEL,
                                                messages=[{"role": "user", "content": "Weather?"}],
                                                tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120,
                                                parallel_tool_calls=False, **kw)
                ch = out.choices[0]
                assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
                [call] = ch.message.tool_calls
                assert call.function.name in names and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

        chunks = list(c.chat.completions.create(model=MODEL,
                                                messages=[{"role": "user", "content": "Weather?"}],
                                                tools=[WEATHER], tool_choice="required", max_tokens=120,
                                                temperature=0, stream=True))
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
        assert [tc.function.name for tc in calls] and all(tc.function.name == "get_weather" for tc in calls)
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas["get_weather"])
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_turns_render_and_tool_choice_none(node):
    c = client(node.url)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "C"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    out = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                    max_tokens=4, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
    status, tok = http_json("POST", node.url + "/tokenize", {"messages": history, "tools": [WEATHER]})
    assert status == 200 and tok["count"] == len(tok["tokens"])
    status, text = http_json("POST", node.url + "/detokenize", {"tokens": tok["tokens"]})
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"' in text["text"]
    assert "<tool_response>-3 C</tool_response>" in text["prompt"]
    # an assistant turn to continue: the template renders no new turn after it
    partial = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1 2 3"}]
    cont = c.chat.completions.create(model=MODEL, messages=partial, max_tokens=2,
                                     extra_body={"continue_final_message": True})
    fresh = c.chat.completions.create(model=MODEL, messages=partial, max_tokens=2)
    assert cont.usage.prompt_tokens < fresh.usage.prompt_tokens


# ------------------------------------------------------------------------------- tokenize, ids, strict fields
def test_tokenize_detokenize_through_the_router(cluster):
    status, tok = http_json("POST", cluster.url + "/tokenize",
                            {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) \
        and tok["max_model_len"]
    status, text = http_json("POST", cluster.url + "/v1/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and text["text"] == "Hello world"
    status, err = http_json("POST", cluster.url + "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and err["error"]["param"] == "tokens[1]"


def test_request_id_is_the_rid_on_every_process(cluster):
    rid = "trace-me-4711"
    res = stream(cluster.url + "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True},
                 request_id=rid)
    assert res.ok, res.error
    out = client(cluster.url).with_options(default_headers={"X-Request-ID": rid
                                                            + "b"}).completions.with_raw_response \
        .create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.headers["x-request-id"] == rid + "b"
    for proc in (*cluster.nodes, cluster.router):
        log = Path(proc.log_path).read_text()
        assert f"rid={rid} " in log and f"rid={rid}b " in log, proc.name


def test_unknown_fields_are_refused_by_name(node, cluster):
    for url in (node.url, cluster.url):
        for extra, name, code in (({"image_data": "x"}, "image_data", "unknown_parameter"),
                                  ({"lora_path": "a"}, "lora_path", "unsupported_value"),
                                  ({"return_hidden_states": True},
                                   "return_hidden_states", "unsupported_value")):
            with pytest.raises(openai.BadRequestError) as e:
                client(url).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra)
            err = e.value.body
            assert err["param"] == name and err["code"] == code, err
        # sglang-router sends these with their defaults on every request: accepted
        out = client(url).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={
            "return_hidden_states": False, "separate_reasoning": True, "stream_reasoning": True,
            "continue_final_message": False})
        assert out.choices[0].finish_reason
