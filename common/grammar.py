"""Constrained decoding with xgrammar: a request's output follows a JSON schema, a regular expression or
an EBNF grammar (SGLang's `json_schema` / `regex` / `ebnf`, OpenAI's `response_format`).

* `GrammarCompiler` turns (kind, source) into a compiled grammar on its own thread, so the scheduler
  loop never waits for a compilation; compiled grammars are cached by (kind, source) (LRU), so a
  schema every request shares compiles once. A source xgrammar refuses is a `GrammarError` (a 400).
* `Grammar` is one request's matcher: `accept(token)` advances it, `fill(bitmask, row)` writes the
  tokens it allows next into one row of a batch bitmask.
* `apply_grammars(logits, grammars)` masks the logits rows of constrained requests in place before
  sampling, so whatever the weights and sampling settings, only grammar-valid tokens can be drawn.

JSON schemas compile without free whitespace (`any_whitespace=False`): the output is compact JSON,
and a model cannot loop on spaces between tokens of the structure. When the grammar is complete the
matcher allows only the end-of-sequence tokens, so a constrained request ends with the grammar.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (each holds the token masks of its states)


class GrammarError(ValueError):
    """The grammar source cannot be compiled; the message says why (served as a 400)."""


def _xgr():
    import xgrammar  # imported on first use: nodes that never see a grammar do not load it

    return xgrammar


class GrammarCompiler:
    """Compiles on one thread of its own. The tokenizer at `tokenizer_path` is read on that thread with
    the first grammar (`tokenizer_info`): the scheduler loop never waits for it. `fast_tokenizer`: the
    `tokenizers.Tokenizer` of that path the caller already holds, if any (not parsed again)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int] | None = None,
                 fast_tokenizer=None) -> None:
        self.tokenizer_path = tokenizer_path
        self.fast_tokenizer = fast_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids or ())
        self.compiler = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.lock = threading.Lock()
        self.compiled = self.hits = 0

    def submit(self, kind: str, source: str) -> Future:
        """A future of the compiled grammar (its exception a `GrammarError`); cached by (kind, source)."""
        key = (kind, source)
        with self.lock:
            fut = self.cache.get(key)
            if fut is not None:
                self.cache.move_to_end(key)
                self.hits += 1
                return fut
            fut = self.pool.submit(self._compile, kind, source)
            self.cache[key] = fut
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return fut

    def _ensure(self):
        if self.compiler is None:
            info = tokenizer_info(self.tokenizer_path, self.vocab_size,
                                  self.eos_token_ids, self.fast_tokenizer)
            self.compiler = _xgr().GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self.compiler

    def _compile(self, kind: str, source: str):
        compiler = self._ensure()  # outside the try: a broken tokenizer is not the request's fault
        try:
            if kind == "json_schema":
                out = compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
            elif kind == "regex":
                out = compiler.compile_regex(source)
            elif kind == "ebnf":
                out = compiler.compile_grammar(source)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            with self.lock:  # a bad source is not kept: the next request gets its own error
                self.cache.pop((kind, source), None)
            raise GrammarError(f"`{kind}` cannot be compiled: {_reason(e)}") from None
        self.compiled += 1
        return out

    def matcher(self, compiled) -> Grammar:
        return Grammar(_xgr().GrammarMatcher(compiled), self.vocab_size)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_info(path: str, vocab_size: int, eos_token_ids: list[int], fast_tokenizer=None):
    """xgrammar's view of the tokenizer at `path`: each token id's string, the vocabulary's encoding,
    the stop tokens. Read from `tokenizer.json` with the `tokenizers` library, as xgrammar reads a Hugging
    Face fast tokenizer, but without loading one through transformers (AutoTokenizer and the modules it
    pulls in): the first grammar request of a fresh node took 4.3-4.6 s with it, 1.5 s without (what is
    left includes importing xgrammar, which imports transformers' top package itself); all of it on the
    grammar thread, whose imports hold the GIL the scheduler loop needs. `fast_tokenizer`: `path`'s
    `tokenizer.json` already loaded with `tokenizers`. tests/unit/test_grammar.py checks it equals
    `TokenizerInfo.from_huggingface`. A
    tokenizer without `tokenizer.json`, without known stop tokens, or that `_fast_vocab` cannot vouch for
    goes through transformers as before."""
    xgr = _xgr()
    fast = _fast_vocab(path, xgr, fast_tokenizer) if eos_token_ids else None
    if fast is not None:
        vocab, meta = fast
        encoded = [""] * vocab_size
        for token, i in vocab.items():
            if i < vocab_size:
                encoded[i] = token
        return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=list(eos_token_ids),
                                 add_prefix_space=meta["add_prefix_space"])
    from transformers import AutoTokenizer

    return xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path), vocab_size=vocab_size,
                                              stop_token_ids=list(eos_token_ids) or None)


def _fast_vocab(path: str, xgr, tok=None) -> tuple[dict[str, int], dict] | None:
    """(token -> id with the added tokens, xgrammar's encoding metadata) from `tokenizer.json`, or None
    where transformers must decide: no such file, an added token of `tokenizer_config.json` it lacks, or
    an encoding the vocabulary contradicts."""
    if tok is None:
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            return None
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(file)
    vocab = tok.get_vocab(with_added_tokens=True)
    config = os.path.join(path, "tokenizer_config.json")
    try:
        added = {}
        if os.path.isfile(config):
            with open(config) as f:
                added = json.load(f).get("added_tokens_decoder") or {}
        if any(vocab.get(t.get("content")) != int(i) for i, t in added.items()):
            return None
        # the detection xgrammar's from_huggingface runs (a pinned version's; gone in another: transformers)
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        by_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    except (OSError, AttributeError, TypeError, ValueError) as e:
        logger.info("tokenizer at %s: read through transformers for grammars (%s)", path, e)
        return None
    if by_vocab is not None and by_vocab != meta["vocab_type"]:
        return None
    return vocab, meta


_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix (time, C++ source location)."""
    text = str(e).strip()
    first = _LOCATION.sub("", text.splitlines()[0]) if text else type(e).__name__
    return first[:300]


class Grammar:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token: int) -> bool:
        """Advance by one output token; False when the grammar does not allow it (the request then
        ended on a token outside the grammar, e.g. the length limit cut it, or EOS after completion)."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammars(logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
    """Set to -inf, in place, the logits of tokens row i's grammar does not allow next (rows without
    a grammar are left as they are). `logits` [len(grammars), vocab] float32."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    xgr = _xgr()
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].fill(bitmask, i)
    if not logits.is_cpu:  # the matchers fill it on the host; xgrammar applies it where the logits are
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
