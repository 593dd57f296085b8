"""Incremental detokenization for streaming output (SGLang's read/surrogate offsets).

Decoding one token at a time is wrong for byte-level BPE (a multi-byte UTF-8 character may be split
across tokens) and for SentencePiece (a token's leading space depends on its left neighbour). So we
keep two offsets into the id list (a few prompt ids followed by the output ids):

* ``surr_offset``: start of the window used as left context,
* ``read_offset``: end of what has been turned into text so far.

Each step decodes ``ids[surr:read]`` and ``ids[surr:]``; the new text is the difference. When the new
text ends in U+FFFD (an incomplete UTF-8 sequence) it is held back until a later token completes it,
for at most ``MAX_HELD_TOKENS`` tokens (a character is at most 4 bytes; a model emitting invalid bytes
would otherwise make every step decode a window that only grows).

While a request runs, a text tail that could be the beginning of one of its stop strings is held back
too, so streamed deltas never have to be taken back; when the request finishes on a stop string the
text is cut where the stop string first occurs (unless ``no_stop_trim``). Every step costs the new text
plus the stop strings' length, never the whole output: `StopScanner` looks for stop strings only in the
tail where a new occurrence can be (the new text and the ``len(stop) - 1`` characters before it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# prompt ids kept as left context for the first output tokens (SGLang uses 5)
INIT_CONTEXT_TOKENS = 5
# tokens whose text may be held back while it ends in an incomplete UTF-8 sequence
MAX_HELD_TOKENS = 16


def special_token_ids(tokenizer) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    return frozenset(ids)


def decode_ids(tokenizer, ids: Sequence[int], *, skip_special_tokens: bool,
               spaces_between_special_tokens: bool, special_ids: frozenset[int] | None = None) -> str:
    """``tokenizer.decode`` plus the slow tokenizers' ``spaces_between_special_tokens`` behaviour:
    special tokens kept in the text are separated from their neighbours by one space."""
    ids = list(ids)
    if skip_special_tokens or not spaces_between_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if special_ids is None:
        special_ids = special_token_ids(tokenizer)
    parts: list[str] = []
    run: list[int] = []
    for t in ids:
        if t in special_ids:
            if run:
                parts.append(tokenizer.decode(run))
                run = []
            parts.append(tokenizer.decode([t]))
        else:
            run.append(t)
    if run:
        parts.append(tokenizer.decode(run))
    return " ".join(parts)


def trim_stop(text: str, finish_reason: dict[str, Any] | None, no_stop_trim: bool,
              first: dict[str, int] | None = None) -> str:
    """Cut ``text`` where the matched stop string first occurs (SGLang's trim_matched_stop for text);
    ``first`` maps stop strings to their first position when a `StopScanner` already knows it."""
    if no_stop_trim or not finish_reason or finish_reason.get("type") != "stop":
        return text
    matched = finish_reason.get("matched")
    if isinstance(matched, str) and matched:
        pos = first.get(matched, -1) if first is not None else text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


class StopScanner:
    """The first occurrence of each stop string in a text that only grows at its end, found by scanning
    only the tail a new occurrence can be in: one not found yet ends in the new text, so it starts at
    most ``len(stop) - 1`` characters before it. ``feed(text)`` after each growth."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.first: dict[str, int] = {}  # stop string -> its first position
        self.scanned = 0  # length of the text already scanned

    def feed(self, text: str) -> None:
        for s in self.stops:
            if s not in self.first:
                pos = text.find(s, max(0, self.scanned - len(s) + 1))
                if pos != -1:
                    self.first[s] = pos
        self.scanned = len(text)


def _held_stop_prefix(text: str, stops: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a prefix of (or equals) a stop string. Only the
    last ``len(stop)`` characters are looked at, and only where the stop string's first character is."""
    best = 0
    n = len(text)
    for s in stops:
        i = max(0, n - len(s))
        while True:
            i = text.find(s[0], i, n - best)  # a start before n - best gives a longer tail than `best`
            if i == -1:
                break
            if s.startswith(text[i:]):
                best = n - i
                break
            i += 1
    return best


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text; ``text`` only ever grows while running."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop_strings: Sequence[str] = (),
                 no_stop_trim: bool = False, special_ids: frozenset[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop_strings = [s for s in stop_strings if s]
        self.no_stop_trim = no_stop_trim
        self.special_ids = special_ids if special_ids is not None else special_token_ids(tokenizer)
        ctx = list(prompt_ids[-INIT_CONTEXT_TOKENS:]) if prompt_ids else []
        self.ids: list[int] = ctx
        self.surr_offset = 0
        self.read_offset = len(ctx)
        self.num_context = len(ctx)
        self.decoded = ""  # text of ids[num_context:read_offset]
        self.stops = StopScanner(self.stop_strings) if self.stop_strings and not no_stop_trim else None
        self.text = ""  # what has been released to the client
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, ids, skip_special_tokens=self.skip_special_tokens,
                          spaces_between_special_tokens=self.spaces_between_special_tokens,
                          special_ids=self.special_ids)

    def _advance(self, final: bool) -> None:
        if self.read_offset >= len(self.ids):
            return
        surr_text = self._decode(self.ids[self.surr_offset:self.read_offset])
        full_text = self._decode(self.ids[self.surr_offset:])
        new_text = full_text[len(surr_text):]
        if final or (new_text and not new_text.endswith("\ufffd")) \
                or len(self.ids) - self.read_offset > MAX_HELD_TOKENS:
            self.decoded += new_text
            if self.stops is not None:
                self.stops.feed(self.decoded)
            self.surr_offset = self.read_offset
            self.read_offset = len(self.ids)

    def step(self, new_ids: Sequence[int], finish_reason: dict[str, Any] | None = None) -> str:
        """Add ``new_ids``; returns the text released by this step (the delta).

        ``finish_reason`` (SGLang's shape) marks the last step: everything is flushed, and the
        matched stop token (id) or stop string is trimmed unless ``no_stop_trim``.
        """
        if self.finished:
            return ""
        new_ids = list(new_ids)
        final = finish_reason is not None
        if final and not self.no_stop_trim and finish_reason.get("type") == "stop" \
                and isinstance(finish_reason.get("matched"), int) and new_ids:
            new_ids = new_ids[:-1]  # the matched stop token is not part of the text
        self.ids.extend(new_ids)
        self._advance(final)
        if final:
            self.finished = True
            full = trim_stop(self.decoded, finish_reason, self.no_stop_trim,
                             self.stops.first if self.stops is not None else None)
            if not full.startswith(self.text):
                # cannot happen with held-back stop prefixes; never take text back from a client
                full = self.text
        else:
            hold = _held_stop_prefix(self.decoded, self.stop_strings) if self.stop_strings else 0
            full = self.decoded[:len(self.decoded) - hold] if hold else self.decoded
            if len(full) < len(self.text):
                full = self.text
        delta = full[len(self.text):]
        self.text = full
        return delta


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Text of each token on its own (for logprobs with ``return_text_in_logprobs``)."""
    return [tokenizer.decode([int(t)]) for t in ids]
