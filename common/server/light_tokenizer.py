"""A model's tokenizer read from its `tokenizer.json`, `tokenizer_config.json` and chat template with the
`tokenizers` library and jinja2, without importing transformers (~0.4 s of a core to load instead of ~2.3 s).

It offers what the front end asks of a tokenizer, with transformers' names: `encode`, `decode`,
`get_vocab`, `len()`, `backend_tokenizer`, `added_tokens_decoder`, `all_special_ids`,
`special_tokens_map`, `chat_template` and `apply_chat_template(..., tokenize=False)`. `tokenizer_load`
hands it out only for a tokenizer it has checked against transformers' (see there); `LightTokenizer.open`
returns None for a directory it cannot read the same way. Named chat templates in `tokenizer_config.json`
give the "default" one (transformers' choice without tools; its tokenizer's `chat_template` is then the
whole set, so the check keeps a node on transformers' tokenizer, and the router renders the default).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from common.server.chat_template import render_chat

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
EXTRA_SPECIAL_TOKENS = ("additional_special_tokens", "extra_special_tokens")


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None


def _read_chat_template(path: str, config: dict) -> str | None:
    if os.path.isfile(os.path.join(path, "chat_template.json")) or os.path.isdir(
            os.path.join(path, "additional_chat_templates")):
        raise ValueError("named chat templates")
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the one transformers takes without tools
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class LightTokenizer:
    def __init__(self, backend, config: dict, chat_template: str | None):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = {name: text for name in NAMED_SPECIAL_TOKENS
                                   if (text := _token_text(config.get(name))) is not None}
        extras = [t for key in EXTRA_SPECIAL_TOKENS for t in (config.get(key) or [])]
        specials = list(self.special_tokens_map.values()) + [t for t in map(_token_text, extras) if t]
        self.all_special_ids = sorted({i for t in specials if (i := backend.token_to_id(t)) is not None})
        self.added_tokens_decoder = {i: AddedToken(t.content, t.special)
                                     for i, t in backend.get_added_tokens_decoder().items()}

    @classmethod
    def open(cls, path: str, chat_template: str | None = None) -> LightTokenizer | None:
        """The tokenizer in directory `path` (with `chat_template`, a `--chat-template` file's text, in place
        of the model's when given), or None when it has no `tokenizer.json` or asks for what this class does
        not do (chat templates in files by name, clean-up of decoded spaces)."""
        from tokenizers import Tokenizer

        try:
            config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
            template = _read_chat_template(path, config) if chat_template is None else chat_template
            if not os.path.isfile(os.path.join(path, "tokenizer.json")) \
                    or config.get("clean_up_tokenization_spaces"):
                return None
            return cls(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), config, template)
        except Exception:  # unreadable files, a tokenizer.json the library refuses (its own exception type)
            return None

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    # The batch calls: the `tokenizers` library lets go of the GIL in them, not in `encode` / `decode`, so a
    # long text tokenized on the front end's pool would stop its event loop (~3 s for 2 MB here).
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def apply_chat_template(self, messages: list[dict], tools: list | None = None, *,
                            documents: list | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = False, **variables) -> str:
        if tokenize:
            raise ValueError("LightTokenizer.apply_chat_template renders text only (tokenize=False)")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render_chat(self.chat_template, messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           variables={**self.special_tokens_map, **variables})
