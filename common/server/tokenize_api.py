"""`/tokenize` and `/detokenize` as vLLM and SGLang offer them (also under `/v1/`).

* `POST /tokenize` `{"prompt": "..."}` (`add_special_tokens`, default true) or `{"messages": [...]}` (the
  chat template with the generation prompt; `add_generation_prompt`, `tools`, `chat_template_kwargs`);
  answers `{"tokens", "count", "max_model_len"}`, plus `token_strs` with `return_token_strs`.
* `POST /detokenize` `{"tokens": [...]}` answers the text as `prompt` (vLLM's name) and `text` (SGLang's).

Every id is checked against the vocabulary; texts are bounded as prompts are.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from common.protocol import BadRequest, ChatMessage
from common.server.http import TM_KEY, read_json
from common.server.openai_api import chat_messages  # the chat endpoint's message rules

DETOKENIZE_INLINE = 512  # tokens decoded on the event loop; more go to the tokenizer threads


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    tokens: list[int]
    model: str | None = None
    skip_special_tokens: bool = False


async def handle_tokenize(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    req: TokenizeRequest = await read_json(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of `prompt` and `messages`")
    if req.prompt is not None:
        [ids] = await tm.encode_texts([(req.prompt, "prompt")], add_special_tokens=req.add_special_tokens)
    else:
        ids = await tm.apply_chat_template(chat_messages(req.messages), req.tools, req.chat_template_kwargs,
                                           add_generation_prompt=req.add_generation_prompt)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": tm.context_length}
    if req.return_token_strs:
        out["token_strs"] = tm.token_texts(ids)
    return web.json_response(out)


async def handle_detokenize(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    req: DetokenizeRequest = await read_json(request, DetokenizeRequest)
    ids = req.tokens
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < tm.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"`tokens[{bad}]` = {ids[bad]} is outside the vocabulary [0, {tm.vocab_size})")
    text = await tm.run_sized(len(ids), DETOKENIZE_INLINE, tm.tokenizer.decode, ids, req.skip_special_tokens)
    return web.json_response({"prompt": text, "text": text})
