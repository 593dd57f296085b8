"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` (non-streaming and SSE streaming).

Parameters map onto SGLang's `SamplingParams` through `common/openai_params.py` (the router checks
requests with the same mapping); responses and stream chunks have the OpenAI API's shapes, so the
official `openai` client parses them. A list of prompts is a batch, and `n` asks for n choices per
prompt: choice `index` k is copy k % n of prompt k // n, each copy a request of its own (the copies
share the prompt's KV through the prefix cache). A request that ends aborted is an error (JSON error,
or an `error` event in a stream). Tools are in `tool_calls.py`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from aiohttp import web

from common.openai_params import max_tokens_field, sampling_params
from common.protocol import (
    BadRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ModelNotFound,
    TokenizedRequest,
)
from common.server.http import (
    INFO_KEY,
    TM_KEY,
    check_batch_size,
    check_top_logprobs,
    copy_of,
    error_event,
    failed,
    item_fields,
    read_request,
    respond,
    sse_done,
    sse_send,
    stream_wait,
)
from common.server.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    joined,
    output_entries,
    prompt_entries,
)
from common.server.tokenizer_manager import ReqState, TokenizerManager
from common.server.tool_calls import ToolStream, parse_answer, plan_tools, template_messages

logger = logging.getLogger("server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's cap; --max-top-logprobs-num may lower it


def top_logprobs_cap(tm: TokenizerManager) -> int:
    return min(MAX_TOP_LOGPROBS, tm.args.max_top_logprobs_num)


def _treqs(tm: TokenizerManager, req, prompts: list[list[int]], batch: bool, *, default_max: int | None,
           prompt_field: str, logprobs: bool, top_n: int, grammar=None,
           logprob_start_len: int = -1) -> list[TokenizedRequest]:
    """The requests of an OpenAI call: `req.n` copies of each prompt, copy j of prompt i at i * n + j,
    each with its rid and rendezvous (`item_fields`)."""
    n = req.n
    sps = [sampling_params(req, tm.room(len(ids), default_max), grammar, tm.sampling_defaults)
           for ids in prompts]
    check_batch_size(tm, len(prompts) * n, prompt_field if n == 1 else "n")
    fields = item_fields(tm.args, req, len(prompts) * n, batch or n > 1)
    out = []
    for i, (ids, sp) in enumerate(zip(prompts, sps, strict=True)):
        tm.check_fits(sp, len(ids), max_field=max_tokens_field(req), prompt_field=prompt_field)
        tm.check_token_ids(sp, "")
        for j in range(n):
            out.append(TokenizedRequest(input_ids=ids, sampling=copy_of(sp, j), stream=req.stream,
                                        return_logprob=logprobs, logprob_start_len=logprob_start_len,
                                        top_logprobs_num=top_n, **fields[i * n + j]))
    if req.user:  # OpenAI's end-user id: it changes nothing in the answer, the log keeps it with the rids
        logger.info("rid=%s user=%r", out[0].rid, req.user[:128])
    return out


def truncated(tm: TokenizerManager, ids: list[int], req) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (its first k with `truncation_side`
    right); -1 keeps as many as leave room for one output token."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = tm.context_length - 1
    if k == 0:
        raise BadRequest("`truncate_prompt_tokens` must be -1 or >= 1")
    return ids[:k] if req.truncation_side == "right" else ids[-k:]


def check_model(request: web.Request, req) -> str:
    """The model name the answer carries: the served one; a request naming another is a 404, as OpenAI's
    API and SGLang answer."""
    served = request.app[INFO_KEY]["served_model_name"]
    if req.model is not None and req.model != served:
        raise ModelNotFound(req.model, served)
    return served


def _finish_reason(st: ReqState) -> str | None:
    if not st.finished or st.finish_reason is None:
        return None
    t = st.finish_reason.get("type")
    return {"stop": "stop", "length": "length"}.get(t, t)


def _abort_error(st: ReqState) -> tuple[int, str] | None:
    err = failed(st)
    if err:
        return err
    if st.finished and (st.finish_reason or {}).get("type") == "abort":
        return 503, (st.finish_reason or {}).get("message") or "request aborted"
    return None


def _usage(states: list[ReqState], n: int = 1) -> dict[str, int]:
    """Token counts of a call (so far, while it runs): each prompt counts once, whatever its number of
    copies `n`."""
    firsts = states[::n]
    p = sum(s.prompt_tokens for s in firsts)
    c = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


class StreamUsage:
    """`stream_options`: `include_usage` adds a last event with the call's usage (and `usage: null` on the
    others), `continuous_usage_stats` puts the usage so far on every event."""

    def __init__(self, req, states: list[ReqState]) -> None:
        opts = req.stream_options
        self.final = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.continuous_usage_stats)
        self.states, self.n = states, req.n

    def add(self, chunk: dict) -> dict:
        if self.continuous:
            chunk["usage"] = _usage(self.states, self.n)
        elif self.final:
            chunk["usage"] = None
        return chunk


async def _stream_items(resp, tm: TokenizerManager, states: list[ReqState], notify):
    """The items of a stream with news, as (index, state, finished) after each wake-up, until every one
    has ended; `finished` is read once, before the caller sends what it has. An item that failed gets
    its error event here and is done."""
    done = [False] * len(states)
    while not all(done):
        await stream_wait(resp, tm, states, notify)
        for i, st in enumerate(states):
            if done[i]:
                continue
            err = _abort_error(st)
            if err:
                await sse_send(resp, error_event(st, *err))
                done[i] = True
                continue
            finished = st.finished
            yield i, st, finished
            done[i] = finished


# -------------------------------------------------------------------------------------------- /v1/completions
async def _completion_prompts(tm: TokenizerManager, prompt: Any) -> tuple[list[list[int]], bool]:
    """The prompts' ids, and whether `prompt` is a batch (a list of strings or of id lists)."""
    if isinstance(prompt, str):
        return [await tm.encode_text(prompt, "prompt")], False
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("`prompt` must be a non-empty string, list of strings, or list of token ids")
    if all(isinstance(p, str) for p in prompt):
        check_batch_size(tm, len(prompt), "prompt")
        return await tm.encode_texts([(p, f"prompt[{i}]") for i, p in enumerate(prompt)]), True
    if all(isinstance(p, list) for p in prompt):
        check_batch_size(tm, len(prompt), "prompt")
        return [tm.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)], True
    return [tm.check_ids(prompt, "prompt")], False


FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_prompt(tm: TokenizerManager, prompt: Any, suffix: str) -> str:
    """`suffix` (fill in the middle): the prompt in the model's FIM form, prefix-suffix-middle, for
    models whose vocabulary has the FIM tokens (StarCoder's or Qwen's names); a 400 for the others."""
    if not isinstance(prompt, str):
        raise BadRequest("`suffix` needs `prompt` to be one string")
    vocab = tm.tokenizer.get_vocab()
    for pre, suf, mid in FIM_TOKENS:
        if pre in vocab and suf in vocab and mid in vocab:
            return f"{pre}{prompt}{suf}{suffix}{mid}"
    raise BadRequest("`suffix`: this model has no fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, "
                     "<fim_middle>)")


class CompletionLogprobs:
    """The legacy `logprobs` of each choice of a completions call (`openai_logprobs.py`). With `echo` the
    prompt's entries come first, on the node that computes them: not on a decode node that receives the
    prompt's KV (the prefill node does), and a prefill node answers those alone."""

    def __init__(self, tm: TokenizerManager, req: CompletionRequest,
                 treqs: list[TokenizedRequest], echo: list[str]):
        self.tm, self.echo = tm, echo
        self.top, self.as_ids = bool(req.logprobs), req.return_tokens_as_token_ids
        mode = tm.args.disaggregation_mode
        self.prompt = [req.echo and not (mode == "decode" and t.bootstrap_room is not None) for t in treqs]
        self.output = mode != "prefill"

    def ready(self, i: int, st: ReqState) -> bool:
        """Whether choice i's first event may go: its prompt's logprobs are in (or it ended without)."""
        return not self.prompt[i] or bool(st.input_logprobs) or st.finished

    def of(self, i: int, st: ReqState, start: int, end: int, first: bool = True) -> dict:
        """Choice i's entries: with `first` (its first event, or the whole answer) its prompt's, then its
        output's [start, end)."""
        tm, top, as_ids = self.tm, self.top, self.as_ids
        out = completion_logprobs(tm, output_entries(st, start, end) if self.output else [],
                                  len(self.echo[i]) if first else 0, top, as_ids)
        if first and self.prompt[i]:
            out = joined(completion_logprobs(tm, prompt_entries(st), 0, top, as_ids), out)
        return out


async def handle_completions(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req: CompletionRequest = await read_request(request, CompletionRequest)
    model = check_model(request, req)
    if req.logprobs is not None:
        check_top_logprobs(tm, req.logprobs, "logprobs", top_logprobs_cap(tm))
    prompt = fim_prompt(tm, req.prompt, req.suffix) if req.suffix else req.prompt
    prompts, batch = await _completion_prompts(tm, prompt)
    prompts = [truncated(tm, ids, req) for ids in prompts]
    want_lp = req.logprobs is not None
    treqs = _treqs(tm, req, prompts, batch, default_max=COMPLETIONS_DEFAULT_MAX_TOKENS, prompt_field="prompt",
                   logprobs=want_lp, top_n=req.logprobs or 0,
                   logprob_start_len=0 if want_lp and req.echo else -1)
    n = req.n
    echo = [await tm.decode(ids) if req.echo else "" for ids in prompts for _ in range(n)]  # before submit
    lps = CompletionLogprobs(tm, req, treqs, echo) if want_lp else None
    states, notify = tm.submit(treqs, endpoint="completions")
    cid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())

    def body():
        choices = [{"index": i, "text": echo[i] + st.text,
                    "logprobs": lps.of(i, st, 0, len(st.output_logprobs)) if lps else None,
                    "finish_reason": _finish_reason(st)} for i, st in enumerate(states)]
        return {"id": cid, "object": "text_completion", "created": created,
                "model": model, "choices": choices, "usage": _usage(states, n)}

    stream = ((lambda resp: _stream_completions(resp, tm, req, states, notify, cid,
                                                created, model, echo, lps))
              if req.stream else None)
    return await respond(request, tm, states, notify, stream, body, error_of=_abort_error)


async def _stream_completions(resp, tm, req, states, notify, cid, created, model, echo, lps) -> None:
    usage = StreamUsage(req, states)
    started = [False] * len(states)
    sent_text = [0] * len(states)
    sent_lp = [0] * len(states)

    async for i, st, finished in _stream_items(resp, tm, states, notify):
        delta = st.text[sent_text[i]:]
        n_lp = len(st.output_logprobs)
        if not started[i]:
            if lps is not None and not lps.ready(i, st):
                continue
            delta = echo[i] + delta
        if started[i] and not delta and not finished and (lps is None or n_lp == sent_lp[i]):
            continue
        lp = lps.of(i, st, sent_lp[i], n_lp, first=not started[i]) if lps is not None else None
        await sse_send(resp,
                       usage.add({"id": cid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [{"index": i, "text": delta, "logprobs": lp,
                                               "finish_reason": _finish_reason(st) if finished else None}]}))
        started[i] = True
        sent_text[i] = len(st.text)
        sent_lp[i] = n_lp
    if usage.final:
        await sse_send(resp, {"id": cid, "object": "text_completion", "created": created, "model": model,
                              "choices": [], "usage": _usage(states, req.n)})
    await sse_done(resp)


# --------------------------------------------------------------------------------------- /v1/chat/completions
def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise BadRequest("`messages` is empty; send at least one message")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise BadRequest(f"`messages[{i}].role` must be one of system/user/assistant/tool/developer, "
                             f"got {m.role!r}")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")  # a refusal part is the text of an earlier refusing answer
                if kind not in ("text", "refusal") or not isinstance(part.get(kind), str):
                    raise BadRequest(f"`messages[{i}].content[{j}]` must be a text part "
                                     "(only text is supported)")
                texts.append(part[kind])
            content = "".join(texts)
        if not content and m.refusal is not None:
            content = m.refusal
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": content or ""}
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise BadRequest(f"`messages[{i}].tool_calls` is only for assistant messages")
            msg["tool_calls"] = [dict(c, function=dict(c["function"]))
                                 if isinstance(c.get("function"), dict) else c
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    if all(not m["content"] and not m.get("tool_calls") for m in out):
        raise BadRequest("`messages` has no content")
    return template_messages(out)


TEMPLATE_FIELDS = ("reasoning_effort", "thinking", "documents")


def template_inputs(tm: TokenizerManager, req: ChatCompletionRequest) -> dict[str, Any]:
    """`chat_template_kwargs` with the request's template fields in (`documents` goes apart, as the
    template's own variable): each must be read by the model's chat template, as it would change nothing
    otherwise."""
    kwargs = dict(req.chat_template_kwargs or {})
    template = tm.chat_template or ""
    for name in TEMPLATE_FIELDS:
        value = getattr(req, name)
        if value is None:
            continue
        if name not in template:
            raise BadRequest(f"`{name}`: this model's chat template does not read it, so it would change "
                             "nothing (start the node with a --chat-template that does)")
        if name != "documents":
            if name in kwargs and kwargs[name] != value:
                raise BadRequest(f"`{name}` and `chat_template_kwargs.{name}` give different values")
            kwargs[name] = value
    return kwargs


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req: ChatCompletionRequest = await read_request(request, ChatCompletionRequest)
    model = check_model(request, req)
    if req.top_logprobs is not None:
        check_top_logprobs(tm, req.top_logprobs, "top_logprobs", top_logprobs_cap(tm))
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("`top_logprobs` needs `logprobs: true`")
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tm.chat_template)
    if req.continue_final_message and req.messages and req.messages[-1].role != "assistant":
        raise BadRequest("`continue_final_message` needs the last message to be the assistant's")
    ids = await tm.apply_chat_template(chat_messages(req.messages), plan.tools, template_inputs(tm, req),
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       documents=req.documents)
    ids = truncated(tm, ids, req)
    treqs = _treqs(tm, req, [ids], False, default_max=None, prompt_field="messages", logprobs=req.logprobs,
                   top_n=req.top_logprobs or 0, grammar=plan.grammar)
    states, notify = tm.submit(treqs, endpoint="chat_completions")
    cid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    as_ids = req.return_tokens_as_token_ids

    def choice(i: int, st: ReqState) -> dict[str, Any]:
        lp = chat_logprobs(tm, st, 0, len(st.output_logprobs), as_ids) if req.logprobs else None
        content, calls = parse_answer(plan, st.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = _finish_reason(st)
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}

    def body():
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": None, "choices": [choice(i, st) for i, st in enumerate(states)],
                "usage": _usage(states, req.n)}

    stream = ((lambda resp: _stream_chat(resp, tm, req, plan, states, notify, cid, created, model))
              if req.stream else None)
    return await respond(request, tm, states, notify, stream, body, error_of=_abort_error)


async def _stream_chat(resp, tm, req, plan, states, notify, cid, created, model) -> None:
    usage = StreamUsage(req, states)
    as_ids = req.return_tokens_as_token_ids

    def chunk(i, delta, finish=None, logprobs=None):
        return usage.add({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                          "system_fingerprint": None,
                          "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish}]})

    for i in range(len(states)):
        await sse_send(resp, chunk(i, {"role": "assistant", "content": ""}))
    splits = [ToolStream(plan) for _ in states]
    sent_lp = [0] * len(states)
    async for i, st, finished in _stream_items(resp, tm, states, notify):
        text, calls = splits[i].feed(st.text, finished)
        n_lp = len(st.output_logprobs)
        if text or (req.logprobs and n_lp > sent_lp[i]):
            lp = chat_logprobs(tm, st, sent_lp[i], n_lp, as_ids) if req.logprobs else None
            await sse_send(resp, chunk(i, {"content": text}, None, lp))
            sent_lp[i] = n_lp
        first = splits[i].calls - len(calls)  # the index of this step's first call in the answer
        for j, call in enumerate(calls):
            await sse_send(resp, chunk(i, {"tool_calls": [dict(call, index=first + j)]}))
        if finished:
            finish = _finish_reason(st)
            if splits[i].calls and finish == "stop":
                finish = "tool_calls"
            await sse_send(resp, chunk(i, {}, finish))
    if usage.final:
        await sse_send(resp,
                       {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "system_fingerprint": None, "choices": [], "usage": _usage(states, req.n)})
    await sse_done(resp)
