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
    TokenizedRequest,
    error_body,
)
from common.server.http import (
    INFO_KEY,
    TM_KEY,
    check_batch_size,
    check_top_logprobs,
    copy_of,
    failed,
    item_fields,
    read_json,
    respond,
    sse_done,
    sse_send,
    stream_wait,
)
from common.server.tokenizer_manager import ReqState, TokenizerManager
from common.server.tool_calls import ToolStream, parse_answer, plan_tools, template_messages

logger = logging.getLogger("server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's cap; --max-top-logprobs-num may lower it


def top_logprobs_cap(tm: TokenizerManager) -> int:
    return min(MAX_TOP_LOGPROBS, tm.args.max_top_logprobs_num)


def _treqs(tm: TokenizerManager, req, prompts: list[list[int]], batch: bool, *, default_max: int | None,
           prompt_field: str, logprobs: bool, top_n: int, grammar=None) -> list[TokenizedRequest]:
    """The requests of an OpenAI call: `req.n` copies of each prompt, copy j of prompt i at i * n + j,
    each with its rid and rendezvous (`item_fields`)."""
    n = req.n
    sps = [sampling_params(req, tm.room(len(ids), default_max), grammar) for ids in prompts]
    check_batch_size(tm, len(prompts) * n, prompt_field if n == 1 else "n")
    fields = item_fields(tm.args, req, len(prompts) * n, batch or n > 1)
    out = []
    for i, (ids, sp) in enumerate(zip(prompts, sps, strict=True)):
        tm.check_fits(sp, len(ids), max_field=max_tokens_field(req), prompt_field=prompt_field)
        tm.check_token_ids(sp, "")
        for j in range(n):
            out.append(TokenizedRequest(input_ids=ids, sampling=copy_of(sp, j), stream=req.stream,
                                        return_logprob=logprobs, top_logprobs_num=top_n, **fields[i * n + j]))
    if req.user:  # OpenAI's end-user id: it changes nothing in the answer, the log keeps it with the rids
        logger.info("rid=%s user=%r", out[0].rid, req.user[:128])
    return out


def model_name(request: web.Request, req) -> str:
    return req.model or request.app[INFO_KEY]["served_model_name"]


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
    """Token counts of a call: each prompt counts once, whatever its number of copies `n`."""
    firsts = states[::n]
    p = sum(s.prompt_tokens for s in firsts)
    c = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


# ---------------------------------------------------------------------------------------------- logprobs
def _completion_logprobs(tm: TokenizerManager, st: ReqState, start: int, end: int, text_offset0: int) -> dict:
    pairs = st.output_logprobs[start:end]
    tokens = tm.token_texts([p[1] for p in pairs])
    tops = []
    for row in st.output_top_logprobs[start:end] if st.top_logprobs_num else []:
        names = tm.token_texts([p[1] for p in row])
        tops.append({n: float(p[0]) for n, p in zip(names, row, strict=True)})
    offsets, off = [], text_offset0
    for t in tokens:
        offsets.append(off)
        off += len(t)
    return {"tokens": tokens, "token_logprobs": [float(p[0]) for p in pairs],
            "top_logprobs": tops if st.top_logprobs_num else None, "text_offset": offsets}


def _chat_logprobs(tm: TokenizerManager, st: ReqState, start: int, end: int) -> dict:
    pairs = st.output_logprobs[start:end]
    tokens = tm.token_texts([p[1] for p in pairs])
    tops = st.output_top_logprobs[start:end]
    content = []
    for k, (p, t) in enumerate(zip(pairs, tokens, strict=True)):
        row = tops[k] if k < len(tops) and st.top_logprobs_num else []
        names = tm.token_texts([q[1] for q in row])
        content.append({"token": t, "logprob": float(p[0]), "bytes": list(t.encode("utf-8")),
                        "top_logprobs": [{"token": n, "logprob": float(q[0]), "bytes": list(n.encode("utf-8"))}
                                         for n, q in zip(names, row, strict=True)]})
    return {"content": content}


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
                await sse_send(resp, error_body(*err))
                done[i] = True
                continue
            finished = st.finished
            yield i, st, finished
            done[i] = finished


# ---------------------------------------------------------------------------------------------- /v1/completions
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


FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_prompt(tm: TokenizerManager, prompt: Any, suffix: str) -> str:
    """`suffix` (fill in the middle): the prompt in the model's FIM form, prefix-suffix-middle, for
    models whose vocabulary has the FIM tokens (StarCoder's or Qwen's names); a 400 for the others."""
    if not isinstance(prompt, str):
        raise BadRequest("`suffix` needs `prompt` to be one string")
    vocab = tm.tokenizer.get_vocab()
    for pre, suf, mid in FIM_TOKENS:
        if pre in vocab and suf in vocab and mid in vocab:
            return f"{pre}{prompt}{suf}{suffix}{mid}"
    raise BadRequest("`suffix`: this model has no fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, <fim_middle>)")


async def handle_completions(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req: CompletionRequest = await read_json(request, CompletionRequest)
    if req.logprobs is not None:
        check_top_logprobs(tm, req.logprobs, "logprobs", top_logprobs_cap(tm))
    prompt = fim_prompt(tm, req.prompt, req.suffix) if req.suffix else req.prompt
    prompts, batch = await _completion_prompts(tm, prompt)
    want_lp = req.logprobs is not None
    treqs = _treqs(tm, req, prompts, batch, default_max=COMPLETIONS_DEFAULT_MAX_TOKENS, prompt_field="prompt",
                   logprobs=want_lp, top_n=req.logprobs or 0)
    n = req.n
    echo = [await tm.decode(ids) if req.echo else "" for ids in prompts for _ in range(n)]  # before submit
    states, notify = tm.submit(treqs, endpoint="completions")
    cid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    model = model_name(request, req)

    def body():
        choices = []
        for i, st in enumerate(states):
            lp = _completion_logprobs(tm, st, 0, len(st.output_logprobs), len(echo[i])) if want_lp else None
            choices.append({"index": i, "text": echo[i] + st.text, "logprobs": lp,
                            "finish_reason": _finish_reason(st)})
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": _usage(states, n)}

    stream = ((lambda resp: _stream_completions(resp, tm, req, states, notify, cid, created, model, echo))
              if req.stream else None)
    return await respond(request, tm, states, notify, stream, body, error_of=_abort_error)


async def _stream_completions(resp, tm, req, states, notify, cid, created, model, echo) -> None:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_lp = req.logprobs is not None
    sent_text = [0] * len(states)
    sent_lp = [0] * len(states)

    def chunk(choices):
        c = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = None
        return c

    async for i, st, finished in _stream_items(resp, tm, states, notify):
        delta = st.text[sent_text[i]:]
        if sent_text[i] == 0 and echo[i]:
            delta = echo[i] + delta
        n_lp = len(st.output_logprobs)
        if not delta and not finished and (not want_lp or n_lp == sent_lp[i]):
            continue
        lp = _completion_logprobs(tm, st, sent_lp[i], n_lp, 0) if want_lp else None
        await sse_send(resp, chunk([{"index": i, "text": delta, "logprobs": lp,
                                     "finish_reason": _finish_reason(st) if finished else None}]))
        sent_text[i] = len(st.text)
        sent_lp[i] = n_lp
    if include_usage:
        await sse_send(resp, {"id": cid, "object": "text_completion", "created": created, "model": model,
                              "choices": [], "usage": _usage(states, req.n)})
    await sse_done(resp)


# ---------------------------------------------------------------------------------------------- /v1/chat/completions
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
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"`messages[{i}].content[{j}]` must be a text part "
                                     "(only text is supported)")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise BadRequest(f"`messages[{i}].tool_calls` is only for assistant messages")
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) if isinstance(c.get("function"), dict) else c
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    if all(not m["content"] and not m.get("tool_calls") for m in out):
        raise BadRequest("`messages` has no content")
    return template_messages(out)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
    if req.top_logprobs is not None:
        check_top_logprobs(tm, req.top_logprobs, "top_logprobs", top_logprobs_cap(tm))
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("`top_logprobs` needs `logprobs: true`")
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tm.chat_template)
    if req.continue_final_message and req.messages and req.messages[-1].role != "assistant":
        raise BadRequest("`continue_final_message` needs the last message to be the assistant's")
    ids = await tm.apply_chat_template(chat_messages(req.messages), plan.tools, req.chat_template_kwargs,
                                       continue_final_message=req.continue_final_message)
    treqs = _treqs(tm, req, [ids], False, default_max=None, prompt_field="messages", logprobs=req.logprobs,
                   top_n=req.top_logprobs or 0, grammar=plan.grammar)
    states, notify = tm.submit(treqs, endpoint="chat_completions")
    cid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    model = model_name(request, req)

    def choice(i: int, st: ReqState) -> dict[str, Any]:
        lp = _chat_logprobs(tm, st, 0, len(st.output_logprobs)) if req.logprobs else None
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
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(i, delta, finish=None, logprobs=None):
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    for i in range(len(states)):
        await sse_send(resp, chunk(i, {"role": "assistant", "content": ""}))
    splits = [ToolStream(plan) for _ in states]
    sent_lp = [0] * len(states)
    async for i, st, finished in _stream_items(resp, tm, states, notify):
        text, calls = splits[i].feed(st.text, finished)
        n_lp = len(st.output_logprobs)
        if text or (req.logprobs and n_lp > sent_lp[i]):
            lp = _chat_logprobs(tm, st, sent_lp[i], n_lp) if req.logprobs else None
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
    if include_usage:
        await sse_send(resp, {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                              "system_fingerprint": None, "choices": [], "usage": _usage(states, req.n)})
    await sse_done(resp)
