"""The way in: what a new request goes through before the scheduler's queues take it.

`Intake.accept(msg)`, in order: a `Req` built from the front end's `TokenizedRequest` (`make_req`);
admission against the queue limit (`Admission`; under priority scheduling a newcomer may take the place
of the lowest-priority request not started yet); a rid already live is refused; the role's checks
(`hooks.validate`) and the scheduler's own (`check_request`: HTTP status and message). An accepted
request waits in the grammar queue while its grammar compiles, then `start` hands it to the role's
queues (`hooks.on_new_request`) or the waiting queue, and records it as admitted for the front end.
`add_prebuilt` is the way in of requests whose prompt KV is already in the pool (a decode node's).
Also here: the decoder that stop strings are matched with.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from common.layers.sampling import make_generator
from common.protocol import BadRequest, TokenizedRequest
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.req import FinishStatus, Req

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
    bad = [t for t, _ in req.sampling.logit_bias_items() if t >= vocab_size] \
        if req.sampling.logit_bias else []
    if bad:
        return 400, f"`logit_bias` has token id {bad[0]} outside the vocabulary (0..{vocab_size - 1})"
    return None


class Intake:
    def __init__(self, args, runner, tokenizer, queues, priority, results, counters) -> None:
        self.runner = runner  # the model's limits, and its EOS tokens (a test may change them)
        self.tokenizer = tokenizer
        self.max_top_logprobs_num = args.max_top_logprobs_num
        self.queues = queues
        self.priority = priority
        self.results = results  # reports refusals; ends a request displaced from a full queue
        self.counters = counters
        self.admission = Admission(args.queued_requests_limit)  # --max-queued-requests
        self.hooks = SchedulerHooks()  # the scheduler's `hooks` setter installs the role's

    def make_req(self, msg: TokenizedRequest) -> Req:
        return make_req(msg, self.runner.eos_token_ids, self.tokenizer)

    def accept(self, msg: TokenizedRequest) -> None:
        """A new request from the front end: refused, or on its way to the queues."""
        req = self.make_req(msg)
        live = self.queues.live_reqs
        full = self.admission.check(msg, self.queues.num_queued)
        # a full queue turns away its lowest priority first: a newcomer that outranks it takes its place
        displaced = (self.priority.queue_full_victim(live.values(), req)
                     if full is not None and msg.batch_size <= 1 else None)
        if full is not None and displaced is None:
            self.refuse(req, *full)
            return
        if msg.rid in live:
            self.refuse(req, 400, f"a request with rid {msg.rid!r} is already running")
            return
        try:
            err = self.hooks.validate(req) or self.check(req)
        except Exception:
            logger.exception("rid=%s validate hook failed; the request is refused", req.rid)
            err = (500, "internal error while validating the request (see the node's log)")
        if err is not None:
            self.refuse(req, *err)
            return
        if displaced is not None:
            self.results.end([displaced.rid], self.priority.turn_away(displaced, req))
        live[req.rid] = req
        self.counters.total_prompt_tokens += len(req.origin_input_ids)
        logger.info("rid=%s received: %d prompt tokens, max_new_tokens=%d, priority=%d", req.rid,
                    len(req.origin_input_ids), req.max_new_tokens, req.priority)
        if req.sampling.grammar() is not None:
            self.queues.grammar_queue.add(req)  # admitted once its grammar is ready
            return
        self.start(req)

    def start(self, req: Req) -> None:
        """An accepted request goes to its role's queues (or the waiting queue) and is admitted."""
        try:
            kept = self.hooks.on_new_request(req)
        except Exception:
            self.results.hook_failed("on_new_request", req)
            return
        if not kept:
            self.queues.add_waiting(req)
        self.admission.admitted(req.rid)

    def add_prebuilt(self, reqs: list[Req]) -> None:
        """Requests whose prompt KV is already in the pool join the running batch without prefill:
        each has `req_pool_idx`, `kv_len` = prompt length and `output_ids` = [first token]."""
        for req in reqs:
            if req.req_pool_idx is None or req.kv_len != len(req.origin_input_ids) or not req.output_ids:
                raise ValueError(f"rid={req.rid}: a prebuilt request needs a req pool row, its prompt's "
                                 "KV and its first output token")
            if self.queues.live_reqs.setdefault(req.rid, req) is not req:
                raise ValueError(f"rid={req.rid} is already live here")
            req.input_logprobs_done = True
            req.scheduled_once = True
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.check_finished():
                self.results.finish(req)
            else:
                self.queues.running_batch.merge([req])
                req.mark("decode")
            self.results.report(req)

    def grammar_failed(self, req: Req, message: str) -> None:
        self.queues.live_reqs.pop(req.rid, None)
        self.refuse(req, 400, message)

    def check(self, req: Req) -> tuple[int, str] | None:
        """(HTTP status, message) when the request cannot be served here, else None."""
        runner = self.runner
        return check_request(req, runner.model_config.vocab_size, runner.context_length,
                             runner.allocator.capacity, self.tokenizer, self.max_top_logprobs_num)

    def refuse(self, req: Req, status: int, message: str, err_type: str | None = None) -> None:
        """End a request that will not be served here; `err_type` names a cause a router acts on."""
        logger.info("rid=%s refused (%d): %s", req.rid, status, message)
        req.finish(FinishStatus.abort(message, err_type=err_type).reason, error_status=status)
        self.results.report(req)
