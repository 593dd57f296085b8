"""OpenAI request fields → SGLang's `SamplingParams`, one mapping for the router (which checks a request
before sending it on) and the node (which runs it). Torch-free: the router imports it.

OpenAI's names map onto SGLang's (max_tokens or max_completion_tokens → max_new_tokens, min_tokens →
min_new_tokens, response_format → json_schema); range errors name the field as the client sent it.
"""

from __future__ import annotations

import json

from common.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, SamplingParams

OpenAIRequest = CompletionRequest | ChatCompletionRequest

ANY_JSON_OBJECT = '{"type": "object"}'


def max_tokens_field(req: OpenAIRequest) -> str:
    """The field that carries the client's output limit (chat takes either name)."""
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


def response_schema(req: OpenAIRequest) -> str | None:
    """The JSON schema `response_format` asks for (as text), None for free text."""
    rf = getattr(req, "response_format", None)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ANY_JSON_OBJECT
    if rf.json_schema is None:
        raise BadRequest("`response_format.json_schema` is required when `response_format.type` is json_schema")
    schema = rf.json_schema.schema
    return json.dumps(schema if schema is not None else {})


def sampling_params(req: OpenAIRequest, default_max: int, grammar: tuple[str, str] | None = None) -> SamplingParams:
    """The verified sampling parameters of an OpenAI request; `default_max` is max_new_tokens when the
    client set no limit; `grammar` (kind, source) one the endpoint imposes (a forced tool call), which
    no other grammar field may contradict. Raises BadRequest naming the OpenAI field."""
    max_field = max_tokens_field(req)
    max_tokens = getattr(req, max_field)
    sp = SamplingParams(
        max_new_tokens=default_max if max_tokens is None else max_tokens, min_new_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
        stop_regex=req.stop_regex, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        no_stop_trim=req.no_stop_trim, n=req.n, seed=req.seed, logit_bias=req.logit_bias,
        json_schema=response_schema(req), regex=req.regex, ebnf=req.ebnf)
    if grammar is not None:
        given = sp.grammar()
        if given is not None:
            field = "response_format" if given[0] == "json_schema" else given[0]
            raise BadRequest(f"`{field}` cannot be combined with `tool_choice` that forces a tool call")
        setattr(sp, grammar[0], grammar[1])
    try:
        sp.verify("$")
    except BadRequest as e:
        msg = str(e).replace("max_new_tokens", max_field).replace("min_new_tokens", "min_tokens")
        msg = msg.replace("`$.json_schema`", "`response_format`")
        raise BadRequest(msg.replace("`$.", "`")) from None
    return sp
