"""Client input → prompt ids and sampling parameters, on the node's tokenizer.

`PromptInput` holds the tokenizer, the model's vocabulary size and context length, and a small
thread pool. Every check raises `BadRequest` naming the client's field:

* `encode_texts` / `encode_text`: text prompts → ids; `check_ids`: token-id prompts are checked
  (in the vocabulary, shorter than the context); `apply_chat_template`: chat messages (with tools
  and documents) → ids through the model's chat template and the client's `chat_template_kwargs`;
* `make_sampling`: SGLang's `sampling_params` → verified `SamplingParams` whose `max_new_tokens`
  fits the context after the prompt (`room`, `check_fits`), logit-bias ids in the vocabulary;
* `decode` and `token_texts`: the ids → text answers need (an echoed prompt, logprob tokens).

Event loop. Small inputs are handled where they come, on the event loop; a large one (by
characters of text, or by tokens to decode) runs on the pool (`run_sized`), so `/health` and other
streams keep answering while it is tokenized. A text longer than the context could hold even at the
tokenizer's most characters per token is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.protocol import BadRequest, SamplingParams, convert
from common.sampling_defaults import fill
from common.server.detokenizer import token_texts

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has no max_new_tokens
# inputs up to this many characters are tokenized on the event loop, where that costs less than the
# hop to the thread pool and back; longer ones go to the pool
INLINE_TOKENIZE_CHARS = 2048
# updates of up to this many tokens are detokenized on the event loop (the incremental window is a few
# tokens); a longer one (the whole answer of a long non-streamed request) goes to the pool
INLINE_DETOKENIZE_TOKENS = 512
TOKENIZER_THREADS = 2
# keyword arguments the server passes to the chat template itself (`chat_template_kwargs` may not)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents",
                                      "add_generation_prompt", "tokenize", "return_dict", "return_tensors",
                                      "chat_template", "padding", "truncation", "max_length",
                                      "continue_final_message"})


def max_chars_per_token(tokenizer) -> int | None:
    """An upper bound on the characters of input text one token of this tokenizer covers, or None when
    it cannot be told (a normalizer may shrink the text; a slow tokenizer). Byte-level and metaspace
    tokens cover at most as many characters as their vocabulary strings have; added tokens match their
    content."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    try:
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:
        return None
    return max((len(t) for t in vocab), default=0) or None


class PromptInput:
    """`context_length` and `vocab_size` start from the tokenizer and the command line; the node's
    scheduler may correct them once it is ready (`TokenizerManager.configure`)."""

    def __init__(self, tokenizer, context_length: int, sampling_defaults: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        # what a request's left-out sampling fields get (common/sampling_defaults.py)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.vocab_size = len(tokenizer)
        self.max_token_chars = max_chars_per_token(tokenizer)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")
        self._token_text_cache: dict[int, str] = {}

    async def run_sized(self, size: int, inline_limit: int, fn, *args):
        """`fn(*args)` on the event loop when `size` is small, else on the tokenizer pool."""
        if size <= inline_limit:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------ text prompts
    def _check_text(self, text: Any, field_name: str) -> str:
        if not isinstance(text, str):
            raise BadRequest(f"`{field_name}` must be a string")
        if not text:
            raise BadRequest(f"`{field_name}` is empty; a prompt needs at least one token")
        self._check_text_length(len(text), field_name)
        return text

    def _check_text_length(self, chars: int, field_name: str) -> None:
        """Refuse, before tokenizing it, a text with more characters than the context's tokens can cover."""
        k = self.max_token_chars
        if k and self.context_length and chars > self.context_length * k:
            raise BadRequest(f"`{field_name}` has {chars} characters: more than the context length of "
                             f"{self.context_length} tokens can hold (a token of this model covers at most "
                             f"{k} characters)")

    def _encode(self, text: str, field_name: str, add_special_tokens: bool) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise BadRequest(f"`{field_name}` tokenizes to no tokens")
        return list(ids)

    async def encode_texts(self, texts: list[tuple[str, str]],
                           add_special_tokens: bool = True) -> list[list[int]]:
        """Prompt ids of each (text, field name); large inputs are tokenized off the event loop."""
        for text, name in texts:
            self._check_text(text, name)
        total = sum(len(t) for t, _ in texts)

        def encode_all() -> list[list[int]]:
            return [self._encode(t, name, add_special_tokens) for t, name in texts]

        return await self.run_sized(total, INLINE_TOKENIZE_CHARS, encode_all)

    async def encode_text(self, text: str, field_name: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_texts([(text, field_name)], add_special_tokens))[0]

    # ------------------------------------------------------------------ token-id prompts
    def check_ids(self, ids: Any, field_name: str) -> list[int]:
        if not isinstance(ids, list):
            raise BadRequest(f"`{field_name}` must be a list of token ids")
        if not ids:
            raise BadRequest(f"`{field_name}` is empty; a prompt needs at least one token")
        if self.context_length and len(ids) >= self.context_length:  # before looking at each id
            raise BadRequest(f"`{field_name}` has {len(ids)} tokens; the context length is "
                             f"{self.context_length} (the prompt plus at least one output token must fit)")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise BadRequest(f"`{field_name}[{i}]` must be an integer token id, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise BadRequest(f"`{field_name}[{i}]` = {t} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return ids

    # ------------------------------------------------------------------ chat messages
    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None,
                                  kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                                  continue_final_message: bool = False,
                                  documents: list[dict[str, Any]] | None = None) -> list[int]:
        """Chat messages (and the tools and documents shown to the model) → prompt ids: the model's chat
        template with the generation prompt and the client's `chat_template_kwargs`; rendered and
        tokenized off the event loop when the messages are large."""
        size = sum(len(m.get("content") or "") for m in messages)
        return await self.run_sized(size, INLINE_TOKENIZE_CHARS, self._render_chat, messages, tools,
                                    kwargs or {}, add_generation_prompt and not continue_final_message,
                                    continue_final_message, documents)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.tokenizer, "chat_template", None)
        return t if isinstance(t, str) or t is None else json.dumps(t)

    def _render_chat(self, messages: list[dict[str, Any]], tools, kwargs: dict[str, Any],
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     documents: list[dict[str, Any]] | None = None) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadRequest("`messages`: this model has no chat template; start the node with "
                             "--chat-template FILE, or send the prompt to /v1/completions")
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise BadRequest(f"`chat_template_kwargs.{reserved[0]}` is set by the server and cannot be given")
        try:
            text = tok.apply_chat_template(messages, tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tokenize=False,
                                           **kwargs)
        except Exception as e:  # jinja raises for messages a template refuses
            raise BadRequest(f"`messages` cannot be rendered by the model's chat template: {e}") from None
        self._check_text_length(len(text), "messages")
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("`messages` renders to an empty prompt")
        return list(ids)

    # ------------------------------------------------------------------ sampling parameters
    def make_sampling(self, raw: dict[str, Any] | None, prompt_len: int, *, where: str = "sampling_params",
                      prompt_field: str = "text") -> SamplingParams:
        """SGLang's `sampling_params` → verified SamplingParams that fit the context with the prompt."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise BadRequest(f"`{where}` must be a JSON object")
        sp = convert(raw, SamplingParams, where)
        fill(sp, (k for k, v in raw.items() if v is not None), self.sampling_defaults)
        if "max_new_tokens" not in raw:
            sp.max_new_tokens = self.room(prompt_len, DEFAULT_MAX_NEW_TOKENS)
        sp.verify(where)
        self.check_fits(sp, prompt_len, max_field=f"{where}.max_new_tokens", prompt_field=prompt_field)
        self.check_token_ids(sp, where)
        return sp

    def check_token_ids(self, sp: SamplingParams, where: str) -> None:
        """Token ids in the sampling parameters must be in the vocabulary."""
        for t, _ in sp.logit_bias_items() if sp.logit_bias else ():
            if t >= self.vocab_size:
                name = f"{where}.logit_bias.{t}" if where else f"logit_bias.{t}"
                raise BadRequest(f"`{name}` is outside the vocabulary [0, {self.vocab_size})")

    def room(self, prompt_len: int, limit: int | None = None) -> int:
        """How many tokens may follow the prompt in the context (at most `limit`)."""
        room = max(self.context_length - prompt_len, 0)
        return room if limit is None else min(room, limit)

    def check_fits(self, sp: SamplingParams, prompt_len: int, *, max_field: str, prompt_field: str) -> None:
        """The prompt plus max_new_tokens must fit the context; the error names the client's fields."""
        room = self.context_length - prompt_len
        if room <= 0:
            raise BadRequest(f"`{prompt_field}` has {prompt_len} tokens; the context length is "
                             f"{self.context_length} (the prompt plus at least one output token must fit)")
        if sp.max_new_tokens > room:
            raise BadRequest(f"`{max_field}` = {sp.max_new_tokens} plus the prompt's {prompt_len} tokens is "
                             f"{sp.max_new_tokens + prompt_len}, more than the context length "
                             f"{self.context_length}")

    # ------------------------------------------------------------------ ids → text for answers
    async def decode(self, ids: list[int]) -> str:
        """`tokenizer.decode(ids)`, off the event loop for long inputs (an echoed prompt)."""
        return await self.run_sized(len(ids), INLINE_DETOKENIZE_TOKENS, self.tokenizer.decode, ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Text of each token on its own (cached: logprob answers repeat them chunk after chunk)."""
        cache = self._token_text_cache
        missing = [t for t in dict.fromkeys(ids) if t not in cache]
        if missing:
            cache.update(zip(missing, token_texts(self.tokenizer, missing), strict=True))
        return [cache[t] for t in ids]
