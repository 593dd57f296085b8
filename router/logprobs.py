"""The prompt's logprobs across PD: the prefill node computes them, the decode node the output's, and the
router joins the two legs' answers into the one the client reads.

* `/generate` (SGLang's shape): the prefill leg's `meta_info.input_token_logprobs` /
  `input_top_logprobs` go before the decode leg's (sglang-router's merge), per item of a batch.
* `/v1/completions` with `echo` and `logprobs` (OpenAI's legacy lists): a prefill node answers each
  choice's prompt entries alone, a decode node its output's; the prefill's go before the decode's in the
  choice's first event (or its whole answer), matched by choice `index`.

`PrefillPrompt.of(body)` reads what the prefill leg answered (a JSON body, or every event of its stream,
framed by router/sse.py); `merge` rewrites one decode answer or event; `StreamMerger` rewrites a decode
stream's events one by one.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router import sse

_decode = msgspec.json.decode
_encode = msgspec.json.encode
LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _objects(body: bytes) -> list[Any]:
    """The JSON objects of an answer: the body, or each JSON event of a stream."""
    body = body.lstrip()
    if not body.startswith(b"data:"):
        return [_decode(body)] if body else []
    return [e.obj for e in sse.events(body) if e.obj is not None]


class PrefillPrompt:
    """What the prefill leg computed of the prompt: its first `/generate` answer, and each completions
    choice's prompt entries by index."""

    def __init__(self, generate: Any, choices: dict[int, dict]) -> None:
        self.generate = generate
        self.choices = choices

    @classmethod
    def of(cls, body: bytes) -> PrefillPrompt:
        events = _objects(body)
        choices: dict[int, dict] = {}
        for obj in events:
            for c in obj.get("choices", ()) if isinstance(obj, dict) else ():
                lp = c.get("logprobs") if isinstance(c, dict) else None
                if isinstance(lp, dict) and isinstance(c.get("index"), int) and lp.get("tokens"):
                    choices.setdefault(c["index"], lp)
        return cls(events[0] if events else None, choices)

    def merge(self, dec: Any, merged: set[int]) -> None:
        """Put the prompt's logprobs into `dec` (a decode answer or event); `merged` holds the choice
        indexes already given theirs (a stream gives each once, in its first event)."""
        _merge_meta(self.generate, dec)
        for c in dec.get("choices", ()) if isinstance(dec, dict) else ():
            if not isinstance(c, dict) or c.get("index") in merged or not isinstance(c.get("logprobs"), dict):
                continue
            merged.add(c.get("index"))
            pre = self.choices.get(c.get("index"))
            if pre is not None:
                c["logprobs"] = _joined(pre, c["logprobs"])


def _joined(pre: dict, dec: dict) -> dict:
    out = dict(dec)
    for key in LISTS:
        a, b = pre.get(key), dec.get(key)
        if isinstance(a, list) or isinstance(b, list):
            out[key] = (a if isinstance(a, list) else []) + (b if isinstance(b, list) else [])
    return out


def _merge_meta(pre, dec) -> None:
    """Prefix the decode leg's prompt logprobs with the prefill leg's (sglang-router's merge)."""
    if isinstance(pre, list) and isinstance(dec, list):
        for p, d in zip(pre, dec, strict=False):
            _merge_meta(p, d)
        return
    if not (isinstance(pre, dict) and isinstance(dec, dict)):
        return
    pm, dm = pre.get("meta_info"), dec.get("meta_info")
    if not (isinstance(pm, dict) and isinstance(dm, dict)):
        return
    for key in ("input_token_logprobs", "input_top_logprobs"):
        a, b = pm.get(key), dm.get(key)
        if isinstance(a, list) and isinstance(b, list):
            dm[key] = a + b


def merged_body(prefill: bytes, body: bytes) -> bytes:
    """A non-streamed decode answer with the prefill leg's prompt logprobs in."""
    dec = _decode(body)
    PrefillPrompt.of(prefill).merge(dec, set())
    return _encode(dec)


class StreamMerger:
    """Rewrites the decode stream's events with the prefill leg's logprobs merged in."""

    def __init__(self, prefill: PrefillPrompt):
        self.prefill = prefill
        self.merged: set[int] = set()

    def rewrite(self, event: sse.Event) -> bytes:
        """The bytes of `event` with the prompt's logprobs in (a comment, [DONE] or data that is not JSON
        unchanged)."""
        obj = event.obj
        if obj is None:
            return event.raw
        self.prefill.merge(obj, self.merged)
        return b"data: " + _encode(obj) + b"\n\n"
