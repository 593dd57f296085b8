"""OpenAI request fields → SGLang's `SamplingParams`, one mapping for the router (which checks a request
before sending it on) and the node (which runs it). Torch-free: the router imports it.

OpenAI's names map onto SGLang's (max_tokens or max_completion_tokens → max_new_tokens, min_tokens →
min_new_tokens, response_format → json_schema) and so do vLLM's (`structured_outputs` → json_schema, regex or
ebnf; `top_k` 0 → -1, both "all tokens"); range errors name the field as the client sent it.
"""

from __future__ import annotations

import json

from common.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, SamplingParams
from common.sampling_defaults import FIELDS, fill

OpenAIRequest = CompletionRequest | ChatCompletionRequest

ANY_JSON_OBJECT = '{"type": "object"}'


def max_tokens_field(req: OpenAIRequest) -> str:
    """The field that carries the client's output limit (chat takes either name)."""
    return "max_completion_tokens" \
        if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


def response_schema(req: OpenAIRequest) -> str | None:
    """The JSON schema `response_format` asks for (as text), None for free text."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ANY_JSON_OBJECT
    if rf.json_schema is None:
        raise BadRequest("`response_format.json_schema` is required when `response_format.type` is "
                         "json_schema")
    schema = rf.json_schema.schema
    return json.dumps(schema if schema is not None else {})


def structured_grammar(req: OpenAIRequest) -> tuple[str, str] | None:
    """(kind, source) of vLLM's `structured_outputs`: exactly one constraint."""
    so = req.structured_outputs
    if so is None:
        return None
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
             if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise BadRequest("`structured_outputs` must give exactly one of json, regex, choice, grammar or "
                         f"json_object{', got ' + ', '.join(given) if given else ''}")
    kind = given[0]
    value = getattr(so, kind)
    if kind == "json":
        return "json_schema", value if isinstance(value, str) else json.dumps(value)
    if kind == "json_object":
        return "json_schema", ANY_JSON_OBJECT
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise BadRequest("`structured_outputs.choice` must be a non-empty list of non-empty strings")
        return "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in value)
    return ("regex", value) if kind == "regex" else ("ebnf", value)


def _grammar(req: OpenAIRequest) -> tuple[str, str, str] | None:
    """(the client's field, SamplingParams' kind, source) of the request's one grammar; two is a 400."""
    given = [("response_format", "json_schema", response_schema(req)),
             ("json_schema", "json_schema", req.json_schema),
             ("regex", "regex", req.regex), ("ebnf", "ebnf", req.ebnf)]
    so = structured_grammar(req)
    if so is not None:
        given.append(("structured_outputs", *so))
    given = [g for g in given if g[2] is not None]
    if len(given) > 1:
        raise BadRequest(f"`{given[1][0]}` cannot be combined with `{given[0][0]}`: give one grammar")
    return given[0] if given else None


def sampling_params(req: OpenAIRequest, default_max: int, grammar: tuple[str, str] | None = None,
                    defaults: dict[str, float | int] | None = None) -> SamplingParams:
    """The verified sampling parameters of an OpenAI request; `default_max` is max_new_tokens when the
    client set no limit; `grammar` (kind, source) one the endpoint imposes (a forced tool call), which
    no other grammar field may contradict; `defaults` the node's sampling defaults
    (`common/sampling_defaults.py`) for the sampling fields the request left out. Raises BadRequest
    naming the OpenAI field."""
    max_field = max_tokens_field(req)
    max_tokens = getattr(req, max_field)
    own = _grammar(req)
    sp = SamplingParams(
        max_new_tokens=default_max if max_tokens is None else max_tokens, min_new_tokens=req.min_tokens,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        stop=req.stop, stop_token_ids=req.stop_token_ids,
        stop_regex=req.stop_regex, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        no_stop_trim=req.no_stop_trim, n=req.n,
        seed=req.seed, logit_bias=req.logit_bias, **({own[1]: own[2]} if own else {}))
    given = {name: getattr(req, name) for name in FIELDS if getattr(req, name) is not None}
    if given.get("top_k") == 0:
        given["top_k"] = -1  # OpenAI-style clients' "no top-k"
    fill(sp, (), {**(defaults or {}), **given})
    if grammar is not None:
        if own is not None:
            raise BadRequest(f"`{own[0]}` cannot be combined with `tool_choice` that forces a tool call")
        setattr(sp, grammar[0], grammar[1])
    try:
        sp.verify("$")
    except BadRequest as e:
        msg = str(e).replace("max_new_tokens", max_field).replace("min_new_tokens", "min_tokens")
        if own is not None:
            msg = msg.replace(f"`$.{own[1]}`", f"`{own[0]}`")
        raise BadRequest(msg.replace("`$.", "`")) from None
    return sp
