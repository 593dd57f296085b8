"""Render a chat template the way transformers' `apply_chat_template(..., tokenize=False)` does, with jinja2
alone.

Importing transformers costs a node's front end ~1.5 s of a core at every start, only to render templates
and wrap the `tokenizers` library; `LightTokenizer` does both without it, and `tokenizer_load` uses it for a
tokenizer only after checking that it answers exactly as transformers does (see there).

What a template sees, as in transformers: a sandbox that cannot modify what it is given, blocks trimmed
(`trim_blocks`, `lstrip_blocks`), `{% break %}` / `{% continue %}`, the `{% generation %}` block (rendered
as its body), a `tojson` filter that keeps non-ASCII text as is, `raise_exception(msg)`, `strftime_now(fmt)`,
`dict(...)` and `namespace(...)` (whose attributes may not start with "_"); `messages` without the keys
whose value is None, a message's reasoning under `reasoning_content` and `thinking` whichever name it came
in, `tools`, `documents` (None), `add_generation_prompt`, the tokenizer's named special tokens and the
caller's variables. `continue_final_message` cuts the text where the last message's content ends.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_MARK = "<<pdserve-continue-here>> "  # appended to the last message; the rendered text is cut at it


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _check_attribute(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _TemplateNamespace(Namespace):
    def __init__(*args, **kwargs):  # Namespace's own signature: `self` may also be an attribute's name
        ns, rest = args[0], args[1:]
        values = dict(*rest, **kwargs)
        for name in values:
            _check_attribute(name)
        Namespace.__init__(ns, values)

    def __setitem__(self, name, value):
        _check_attribute(name)
        Namespace.__setitem__(self, name, value)


class _DictMaker:
    """`dict(...)` in a template: builds plain dicts, and exposes nothing of the type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args) -> dict:
        return dict.fromkeys(*args)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_DictMaker(), namespace=_TemplateNamespace)
    return env.from_string(text)


def _template_message(message: dict) -> dict:
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out}
        out["reasoning_content"] = reasoning
    return out


def _mark_final_content(message: dict) -> str:
    """Append CONTINUE_MARK to the last message's text (its last text part when the content is a list of
    parts, in a new list); return that text as it was. `message` is the caller's own copy."""
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = content + CONTINUE_MARK
        return content
    if isinstance(content, list):
        for i in range(len(content) - 1, -1, -1):
            part = content[i]
            if isinstance(part, dict) and "text" in part:
                message["content"] = [*content[:i],
                                      {**part, "text": part["text"] + CONTINUE_MARK}, *content[i + 1:]]
                return part["text"]
        raise ValueError("continue_final_message: the final message has no text part to continue")
    raise ValueError('continue_final_message: the final message has no "content" to continue')


def render_chat(template: str, messages: list[dict], *, tools: list | None = None,
                documents: list | None = None,
                add_generation_prompt: bool = False, continue_final_message: bool = False,
                variables: dict[str, Any] | None = None) -> str:
    """The prompt text `template` makes of `messages`; raises (jinja2's errors, ValueError) where the
    template or the conversation cannot give one."""
    if not messages:
        raise ValueError("the conversation is empty")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    chat = [_template_message(m) if isinstance(m, dict) else m for m in messages]
    for m in chat:
        if not isinstance(m, dict):
            raise TypeError(f"a chat message must be an object, got {m!r}")
    final = None
    if continue_final_message:
        if "content" not in template:
            raise ValueError('continue_final_message: the chat template does not read "content"')
        final = _mark_final_content(chat[-1])  # chat[-1] is _template_message's new dict
    text = compile_template(template).render(messages=chat, tools=tools, documents=documents,
                                             add_generation_prompt=add_generation_prompt, **(variables or {}))
    if final is None:
        return text
    mark = CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ValueError("continue_final_message: the chat template drops part of the final message")
    at = text.rindex(mark)
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()

