"""Prompt token ids in the router, the way a node computes them, without torch.

The nodes tokenize with transformers' fast tokenizer, and transformers imports torch, which the router
never does. A fast tokenizer is the `tokenizers` library running the model's `tokenizer.json` (special
tokens added by its post-processor), so the router loads that file directly; chat requests are rendered
with the model's chat template through jinja2 with the settings and variables transformers uses (a
sandboxed environment with trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML, the special tokens by name) and encoded without added special tokens, as
`TokenizerManager.apply_chat_template` does. `tests/router/test_kv_routing.py` checks the ids against
transformers for plain text and chat.

`prompt_ids(path, obj)` gives the ids of the first prompt of a request body (what the prefill node will
look up in its prefix cache); None when the router cannot tell (a body the node would refuse, a
template that does not render).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(path: str, config: dict) -> str | None:
    """chat_template.jinja next to the tokenizer (transformers 5's place), else tokenizer_config.json's."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


class RouterTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                loaded = json.load(f)
            config = loaded if isinstance(loaded, dict) else {}
        self.special = {name: t for name in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(name))) is not None}
        self.chat_template = _chat_template(path, config)
        self._template = None

    @staticmethod
    def usable(path: str | None) -> bool:
        return bool(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _compiled(self):
        if self._template is None:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template

    def use_template(self, text: str) -> None:
        """The template the worker renders chat with (its --chat-template), instead of the model's."""
        self.chat_template, self._template = text, None

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:  # the node answers such a chat request 400: nothing to route by
            raise ValueError("the model has no chat template")
        return self._compiled().render(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=True, **self.special)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)


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
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    return None
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            return None
        out.append({"role": "system" if role == "developer" else role, "content": content or ""})
    return out


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
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


def tokenize(tok: RouterTokenizer | None, kind: str, value: Any) -> list[int] | None:
    if kind == "ids":
        return list(value)
    if tok is None:
        return None
    try:
        return tok.encode(value) if kind == "text" else tok.chat_ids(value)
    except Exception:  # a template that refuses these messages: the node answers 400, nothing to route by
        return None
