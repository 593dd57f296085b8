"""The `logprobs` of OpenAI answers, built from a request's state.

* `/v1/completions` (the legacy shape: parallel lists `tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`). With `echo` the lists cover the prompt first, its first token's logprob null as in
  OpenAI's API, then the output. Across PD the prompt's logprobs are computed on the prefill node and the
  output's on the decode node, so a prefill node answers the prompt's entries only, a decode node the
  output's, and the router joins them (`router/logprobs.py`).
* `/v1/chat/completions` (`content`: one object per output token).

With vLLM's `return_tokens_as_token_ids` every token is named `token_id:<id>`, so tokens that are not
whole characters stay distinct.
"""

from __future__ import annotations

from typing import Any

from common.server.request_state import ReqState
from common.server.tokenizer_manager import TokenizerManager

Entry = tuple[int, float | None, list[tuple[float, int]] | None]  # token id, its logprob, its top row


def names(tm: TokenizerManager, ids: list[int], as_ids: bool) -> list[str]:
    return [f"token_id:{t}" for t in ids] if as_ids else tm.token_texts(ids)


def prompt_entries(st: ReqState) -> list[Entry]:
    tops = st.input_top_logprobs
    return [(tid, lp, tops[k] if k < len(tops) else None) for k, (lp, tid) in enumerate(st.input_logprobs)]


def output_entries(st: ReqState, start: int, end: int) -> list[Entry]:
    tops = st.output_top_logprobs
    return [(tid, lp, tops[start + k] if st.top_logprobs_num and start + k < len(tops) else None)
            for k, (lp, tid) in enumerate(st.output_logprobs[start:end])]


def completion_logprobs(tm: TokenizerManager, entries: list[Entry], offset: int,
                        top: bool, as_ids: bool) -> dict:
    """The legacy lists of `entries`, their text offsets counted from `offset`; `top_logprobs` null
    without `top` (logprobs 0), and null at a position with no row (the prompt's first token)."""
    tokens = names(tm, [e[0] for e in entries], as_ids)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = None
    if top:
        tops = []
        for _, _, row in entries:
            if row is None:
                tops.append(None)
                continue
            row_names = names(tm, [q[1] for q in row], as_ids)
            tops.append({n: float(q[0]) for n, q in zip(row_names, row, strict=True)})
    return {"tokens": tokens, "token_logprobs": [None if e[1] is None else float(e[1]) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict, second: dict) -> dict:
    """Two parts of one choice's legacy lists, one after the other."""
    out: dict[str, Any] = {}
    for key in ("tokens", "token_logprobs", "text_offset"):
        out[key] = first[key] + second[key]
    a, b = first["top_logprobs"], second["top_logprobs"]
    out["top_logprobs"] = None if a is None and b is None else (a or []) + (b or [])
    return out


def chat_logprobs(tm: TokenizerManager, st: ReqState, start: int, end: int, as_ids: bool) -> dict:
    content = []
    for tid, lp, row in output_entries(st, start, end):
        [name] = names(tm, [tid], as_ids)
        row = row or []
        row_names = names(tm, [q[1] for q in row], as_ids)
        content.append({"token": name, "logprob": float(lp), "bytes": list(name.encode("utf-8")),
                        "top_logprobs": [{"token": n, "logprob": float(q[0]),
                                          "bytes": list(n.encode("utf-8"))}
                                         for n, q in zip(row_names, row, strict=True)]})
    return {"content": content}
