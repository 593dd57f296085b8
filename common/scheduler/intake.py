"""What a new request goes through before the scheduler takes it: admission against the queue limit
(`Admission`), a `Req` built from the front end's `TokenizedRequest`, the checks that refuse it (HTTP
status and message), and the decoder that stop strings are matched with."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from common.layers.sampling import make_generator
from common.protocol import BadRequest, TokenizedRequest
from common.scheduler.req import Req

logger = logging.getLogger("scheduler")


class _TailDecoder:
    """`decode(ids)` of a `tokenizers.Tokenizer`, special tokens kept (they can be stop strings)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def fast_tokenizer(decoder):
    """The `tokenizers.Tokenizer` behind a decoder from `load_stop_decoder`, or None (a transformers one)."""
    return decoder.tok if isinstance(decoder, _TailDecoder) else None


def load_stop_decoder(path: str):
    """A decoder for stop strings: `tokenizer.json` through the `tokenizers` library (fast to load;
    transformers is not imported in the scheduler process), else transformers'; None without one."""
    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            from tokenizers import Tokenizer

            return _TailDecoder(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a model dir without a tokenizer still serves token ids
        logger.warning("no tokenizer at %s (%s): stop strings will be refused", path, e)
        return None


class Admission:
    """--max-queued-requests at the scheduler's intake, where the count is exact: every TP rank takes
    the same messages in the same order and counts the same queues, so all ranks decide alike.

    `check(msg, queued)` runs first for every new request; `queued()` counts the requests the node
    holds that are not running yet. The items of one HTTP request arrive one after the other: the
    first (`batch_index` 0, `batch_size` n) decides for all n, which are then admitted or refused
    together. Admitted rids are collected for the front end (`take_admitted`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.refused = 0  # requests answered 429 since start
        self._group_left = 0  # items of the current batch still to come
        self._group_error: tuple[int, str] | None = None
        self._admitted: list[str] = []

    def check(self, msg: TokenizedRequest, queued: Callable[[], int]) -> tuple[int, str] | None:
        if msg.batch_index > 0 and self._group_left > 0:
            self._group_left -= 1
            err = self._group_error
        else:
            size = max(msg.batch_size, 1) if msg.batch_index == 0 else 1  # an orphan item decides alone
            self._group_left = size - 1
            n = queued()
            err = None
            if n + size > self.limit:
                what = f"a batch of {size} requests" if size > 1 else "a new request"
                err = (429, f"the node's queue is full: {n} requests wait to run and {what} would pass "
                            f"--max-queued-requests={self.limit}; retry later")
            self._group_error = err
        if err is not None:
            self.refused += 1
        return err

    def admitted(self, rid: str) -> None:
        self._admitted.append(rid)

    def take_admitted(self) -> list[str]:
        out, self._admitted = self._admitted, []
        return out


def make_req(msg: TokenizedRequest, eos_token_ids: list[int], tokenizer: Any) -> Req:
    seed = msg.sampling.seed
    req = Req(msg.rid, msg.input_ids, msg.sampling, stream=msg.stream,
               return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
               top_logprobs_num=msg.top_logprobs_num,
               generator=make_generator(seed) if seed is not None else None,
               eos_token_ids=eos_token_ids, tokenizer=tokenizer,
               bootstrap_host=msg.bootstrap_host, bootstrap_port=msg.bootstrap_port,
               bootstrap_room=msg.bootstrap_room, arrival_time=msg.arrival_time or None)
    req.priority = msg.priority
    req.traceparent = msg.traceparent
    return req


def check_request(req: Req, vocab_size: int, context_length: int, kv_capacity: int,
                  tokenizer: Any, max_top_logprobs_num: int | None = None) -> tuple[int, str] | None:
    """(HTTP status, message) when the request cannot be served, else None."""
    n = len(req.origin_input_ids)
    if n == 0:
        return 400, "the prompt is empty (input_ids has no tokens)"
    bad = [t for t in req.origin_input_ids if not 0 <= t < vocab_size]
    if bad:
        return 400, f"input_ids contains token id {bad[0]} outside the vocabulary (0..{vocab_size - 1})"
    try:
        req.sampling.verify()
    except BadRequest as e:
        return 400, str(e)
    total = n + req.max_new_tokens
    if total > context_length:
        return 400, (f"the prompt has {n} tokens and max_new_tokens is {req.max_new_tokens}: "
                     f"{total} tokens exceed the context length of {context_length}")
    if total > kv_capacity:
        return 400, (f"the prompt has {n} tokens and max_new_tokens is {req.max_new_tokens}: "
                     f"{total} tokens exceed the KV cache size of {kv_capacity} tokens")
    if req.top_logprobs_num < 0:
        return 400, f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
    if max_top_logprobs_num is not None and req.top_logprobs_num > max_top_logprobs_num:
        return 400, (f"top_logprobs_num = {req.top_logprobs_num} is more than --max-top-logprobs-num "
                     f"({max_top_logprobs_num})")
    if (req.stop_strs or req.stop_regexes or req.sampling.grammar()) and tokenizer is None:
        return 400, "stop strings and grammars need a tokenizer, and this model directory has none"
    bad = [t for t, _ in req.sampling.logit_bias_items() if t >= vocab_size] if req.sampling.logit_bias else []
    if bad:
        return 400, f"`logit_bias` has token id {bad[0]} outside the vocabulary (0..{vocab_size - 1})"
    return None
