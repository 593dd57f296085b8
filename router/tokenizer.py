"""Prompt token ids in the router, the way a node computes them, without torch or transformers.

The router reads the model's tokenizer as a node's front end reads it once checked against transformers'
(common/server/light_tokenizer.py: the `tokenizers` library on `tokenizer.json`, the chat template
through the same jinja2 sandbox and variables) and encodes a rendered chat without added special tokens,
as `TokenizerManager.apply_chat_template` does. `tests/router/test_kv_routing.py` checks the ids against
transformers for plain text and chat.

`prompt_source(path, obj)` says what the first prompt of a request body is (what the prefill node will
look up in its prefix cache) and `tokenize` its ids; None when the router cannot tell (a body the node
would refuse, a template that does not render).
"""

from __future__ import annotations

from typing import Any

from common.server.light_tokenizer import LightTokenizer


def chat_messages(raw: Any) -> list[dict[str, str]] | None:
    """The node's reading of `messages` (common/server/openai_api.py): text parts joined, `developer` as
    `system`, a missing content as ""; None for what the node refuses."""
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for m in raw:
        if not isinstance(m, dict):
            return None
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            return None
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    return None
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            return None
        out.append({"role": "system" if role == "developer" else role, "content": content or ""})
    return out


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int)
                                                 and not isinstance(t, bool) for t in value):
        return value
    return None


def prompt_source(path: str, obj: dict) -> tuple[str, Any] | None:
    """What to tokenize for the first prompt of a body: ("ids", ids), ("text", str) or ("chat", messages)."""
    if path == "/generate":
        text, ids = obj.get("text"), obj.get("input_ids")
        if isinstance(text, list):
            text = text[0] if text else None
        if isinstance(text, str) and text:
            return "text", text
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]
        ids = _ids(ids)
        return ("ids", ids) if ids else None
    if path == "/v1/completions":
        p = obj.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            p = p[0]
        if isinstance(p, str) and p:
            return "text", p
        ids = _ids(p)
        return ("ids", ids) if ids else None
    messages = chat_messages(obj.get("messages"))
    return ("chat", messages) if messages else None


def source_size(kind: str, value: Any) -> int:
    """Characters (or ids) to tokenize: decides whether the work leaves the event loop."""
    if kind == "chat":
        return sum(len(m["content"]) for m in value)
    return len(value)


def tokenize(tok: LightTokenizer | None, kind: str, value: Any) -> list[int] | None:
    if kind == "ids":
        return list(value)
    if tok is None:
        return None
    try:
        if kind == "text":
            return tok.encode(value)
        return tok.encode(tok.apply_chat_template(value, add_generation_prompt=True),
                          add_special_tokens=False)
    except Exception:  # a template that refuses these messages: the node answers 400, nothing to route by
        return None
