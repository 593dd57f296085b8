"""OpenAI request fields → SGLang's `SamplingParams`, one mapping for the router (which checks a request
before sending it on) and the node (which runs it). Torch-free: the router imports it.

OpenAI's names map onto SGLang's (max_tokens or max_completion_tokens → max_new_tokens, min_tokens →
min_new_tokens); range errors name the field as the client sent it.
"""

from __future__ import annotations

from common.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, SamplingParams

OpenAIRequest = CompletionRequest | ChatCompletionRequest


def max_tokens_field(req: OpenAIRequest) -> str:
    """The field that carries the client's output limit (chat takes either name)."""
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


def sampling_params(req: OpenAIRequest, default_max: int) -> SamplingParams:
    """The verified sampling parameters of an OpenAI request; `default_max` is max_new_tokens when the
    client set no limit. Raises BadRequest naming the OpenAI field."""
    if req.logit_bias:
        raise BadRequest("`logit_bias` is not supported by this server")
    max_field = max_tokens_field(req)
    max_tokens = getattr(req, max_field)
    sp = SamplingParams(
        max_new_tokens=default_max if max_tokens is None else max_tokens, min_new_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens, no_stop_trim=req.no_stop_trim,
        n=req.n, seed=req.seed)
    try:
        sp.verify("$")
    except BadRequest as e:
        msg = str(e).replace("max_new_tokens", max_field).replace("min_new_tokens", "min_tokens")
        raise BadRequest(msg.replace("`$.", "`")) from None
    return sp
