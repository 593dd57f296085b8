"""Scheduler: the event loop of one TP rank (prefill-first continuous batching).

One iteration (`event_loop` → `recv_requests` + `process_input_requests` + `step`):
1. messages from the front end: new requests (validated: refused at once with error_status 400
   when they cannot fit), aborts, stats queries, cache flushes;
2. `get_next_batch_to_run`: a new prefill batch if any request can be admitted (the request being
   chunked goes first), else one decode step of the running batch (retracting requests when KV
   memory runs out);
3. `run_batch`: forward + sample; 4. `process_batch_result`: append tokens and logprobs, check
   stops, release finished requests' memory (into the radix cache);
5. `stream_output`: one `BatchOut` with every request that has something to report.

Without a communicator (`comm=None`) the scheduler is driven in-process: call
`process_input_requests([...])` and `step()` and collect what `send_fn` receives.

Hooks for the PD roles (override in subclasses):
* `validate_request(req) -> (status, message) | None`; `add_new_request(req)` (where a validated
  request goes: here the waiting queue; a prefill node's bootstrap queue, a decode node's prealloc
  queue);
* `process_queues()` (called every iteration before scheduling: poll transfers, move requests
  between stage queues); `has_pending_work()` (extra queues that keep the loop from blocking);
* `get_next_batch_to_run()`, `get_new_batch_prefill()`, `update_running_batch()`;
* `run_batch(batch)`, `process_batch_result_prefill(batch, result)` /
  `process_batch_result_decode(batch, result)` with `on_prefill_chunk_done(req)` (a chunk's KV is in
  the cache) and `on_prefill_done(req)` (prefill finished, first token sampled);
* `release_req(req)` (free or cache a finished request's memory), `abort_request(rid, message)` with
  `abort_in_extra_queues(rid, message)`, `queue_counts()` (stage → count for stats);
* `add_prebuilt_reqs(reqs)`: requests whose KV is already in the pool (a decode node's received
  KV): each has `req_pool_idx`, `kv_len` = prompt length and `output_ids` = [first token]; they
  join the running batch without prefill compute.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.config import ServerArgs
from common.forward_batch import ForwardMode
from common.layers.sampling import SamplingBatchInfo, make_generator
from common.memory.radix_cache import make_tree_cache
from common.protocol import (
    AbortRequest,
    BadRequest,
    BatchOut,
    FlushCacheRequest,
    ReqUpdate,
    StatsQuery,
    StatsReport,
    TokenizedRequest,
)
from common.scheduler.batch import ScheduleBatch
from common.scheduler.policy import NewTokenRatio, SchedulePolicy
from common.scheduler.prefill_adder import AddResult, PrefillAdder
from common.scheduler.req import Req, Stage

logger = logging.getLogger("scheduler")


@dataclass
class BatchResult:
    """What one forward produced, per request of the batch (None where nothing was sampled)."""

    next_token_ids: list[int | None]
    token_logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]
    # extend only: per request, (logprobs of prompt tokens, their top logprobs) computed this chunk
    input_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None


class _TailDecoder:
    """`decode(ids)` of a `tokenizers.Tokenizer`, special tokens kept (they can be stop strings)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


class Scheduler:
    def __init__(self, args: ServerArgs, model_dir: str, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, *, runner=None, tokenizer: Any = None,
                 send_fn: Callable[[Any], None] | None = None, comm=None) -> None:
        self.args = args
        self.model_dir = model_dir
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        if runner is None:
            from common.runner import ModelRunner

            runner = ModelRunner(args, model_dir, tp_rank, tp_size, tp_group)
        self.runner = runner
        self.model_config = runner.model_config
        self.eos_token_ids = list(self.model_config.eos_token_ids or [])
        self.vocab_size = self.model_config.vocab_size
        self.context_length = runner.context_length
        self.page_size = runner.page_size
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator
        self.kv_pool = runner.kv_pool
        self.max_running_requests = args.max_running_requests
        # models with recurrent state (hybrid) cannot reuse a cached prefix: see common/hybrid.py
        self.tree_cache = make_tree_cache(args.radix_cache_enabled and getattr(runner, "supports_radix_cache", True),
                                          self.req_to_token_pool, self.allocator, self.page_size)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.policy = SchedulePolicy(args.schedule_policy, self.tree_cache)
        self.new_token_ratio = NewTokenRatio(args.init_new_token_ratio, args.min_new_token_ratio,
                                             args.new_token_ratio_decay_steps)

        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], self.req_to_token_pool, self.allocator, self.kv_pool,
                                           self.tree_cache)
        self.chunked_req: Req | None = None
        self.live_reqs: dict[str, Req] = {}

        self.send_fn = send_fn
        self.comm = comm
        self._updates: list[ReqUpdate] = []
        self._update_rids: set[str] = set()
        self._pending_offsets: dict[str, tuple[Req, int]] = {}
        self.stopping = False
        self.idle_poll_ms = 500
        self.busy_poll_ms = 2

        # statistics
        self.forward_ct = 0
        self.num_retractions = 0
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.total_generated_tokens = 0
        self._gen_window: collections.deque[tuple[float, int]] = collections.deque()

    def _load_tokenizer(self):
        """A decoder for stop strings: `tokenizer.json` through the `tokenizers` library (fast to
        load; transformers is not imported in the scheduler process), else transformers'."""
        path = self.args.tokenizer or self.model_dir
        try:
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                from tokenizers import Tokenizer

                return _TailDecoder(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        except Exception as e:  # a model dir without a tokenizer still serves token ids
            logger.warning("no tokenizer at %s (%s): stop strings will be refused", path, e)
            return None

    # ================================================================== input
    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedRequest):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortRequest):
                self.abort_request(msg.rid, msg.message)
            elif isinstance(msg, StatsQuery):
                self.send(StatsReport(qid=msg.qid, stats=self.get_stats()))
            elif isinstance(msg, FlushCacheRequest):
                ok = self.flush_cache()
                self.send(StatsReport(qid=msg.qid, stats={"flushed": ok, **self.get_stats()}))
            else:
                logger.warning("unknown message %r", type(msg).__name__)

    def make_req(self, msg: TokenizedRequest) -> Req:
        seed = msg.sampling.seed
        return Req(msg.rid, msg.input_ids, msg.sampling, stream=msg.stream,
                   return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                   top_logprobs_num=msg.top_logprobs_num,
                   generator=make_generator(seed) if seed is not None else None,
                   eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer,
                   bootstrap_host=msg.bootstrap_host, bootstrap_port=msg.bootstrap_port,
                   bootstrap_room=msg.bootstrap_room, arrival_time=msg.arrival_time or None)

    def handle_generate_request(self, msg: TokenizedRequest) -> None:
        req = self.make_req(msg)
        if msg.rid in self.live_reqs:
            self.finish_refused(req, 400, f"a request with rid {msg.rid!r} is already running")
            return
        err = self.validate_request(req)
        if err is not None:
            self.finish_refused(req, *err)
            return
        self.live_reqs[req.rid] = req
        self.total_prompt_tokens += len(req.origin_input_ids)
        logger.info("rid=%s received: %d prompt tokens, max_new_tokens=%d", req.rid,
                    len(req.origin_input_ids), req.max_new_tokens)
        self.add_new_request(req)

    def validate_request(self, req: Req) -> tuple[int, str] | None:
        """(HTTP status, message) when the request cannot be served, else None."""
        n = len(req.origin_input_ids)
        if n == 0:
            return 400, "the prompt is empty (input_ids has no tokens)"
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.vocab_size]
        if bad:
            return 400, f"input_ids contains token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})"
        try:
            req.sampling.verify()
        except BadRequest as e:
            return 400, str(e)
        total = n + req.max_new_tokens
        if total > self.context_length:
            return 400, (f"the prompt has {n} tokens and max_new_tokens is {req.max_new_tokens}: "
                         f"{total} tokens exceed the context length of {self.context_length}")
        if total > self.allocator.capacity:
            return 400, (f"the prompt has {n} tokens and max_new_tokens is {req.max_new_tokens}: "
                         f"{total} tokens exceed the KV cache size of {self.allocator.capacity} tokens")
        if req.top_logprobs_num < 0:
            return 400, f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
        if req.stop_strs and self.tokenizer is None:
            return 400, "stop strings need a tokenizer, and this model directory has none"
        return None

    def add_new_request(self, req: Req) -> None:
        """Hook: where a validated request goes."""
        self.waiting_queue.append(req)

    def finish_refused(self, req: Req, status: int, message: str) -> None:
        logger.info("rid=%s refused (%d): %s", req.rid, status, message)
        req.finish({"type": "abort", "message": message}, error_status=status)
        self.collect_update(req)

    # ================================================================== aborts
    def abort_request(self, rid: str, message: str = "aborted by client") -> None:
        """Abort one request (or all of them for rid ""), wherever it is; frees its memory now."""
        if rid == "":
            for r in list(self.live_reqs):
                self.abort_request(r, message)
            return
        req = self.live_reqs.get(rid)
        if req is None:
            return
        logger.info("rid=%s aborted (%s) at stage %s", rid, message, req.stage.value)
        req.to_abort = message
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        elif req is self.chunked_req:
            self.chunked_req = None
        elif req in self.running_batch.reqs:
            self.running_batch.filter(lambda r: r is not req)
        elif not self.abort_in_extra_queues(req, message):
            logger.warning("rid=%s is live but in no queue", rid)
        req.finish({"type": "abort", "message": message})
        self.release_req(req)
        self.collect_update(req)

    def abort_in_extra_queues(self, req: Req, message: str) -> bool:
        """Hook: remove the request from role-specific queues; True if it was found."""
        return False

    # ================================================================== scheduling
    def has_pending_work(self) -> bool:
        """Hook: work in role-specific queues that keeps the loop from blocking."""
        return False

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req is not None
                    or self.has_pending_work())

    def process_queues(self) -> None:
        """Hook: called every iteration before scheduling (PD roles poll their transfers here)."""

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if self.running_batch.reqs:
            return self.update_running_batch()
        return None

    def num_running_slots_used(self) -> int:
        return len(self.running_batch.reqs) + (1 if self.chunked_req is not None else 0)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if self.chunked_req is None and not self.waiting_queue:
            return None
        slots_left = self.max_running_requests - self.num_running_slots_used()
        if self.chunked_req is None and slots_left <= 0:
            return None
        self.policy.calc_priority(self.waiting_queue)
        adder = PrefillAdder(self.tree_cache, self.allocator, self.running_batch.reqs,
                             self.new_token_ratio.value, self.args.max_prefill_tokens,
                             self.args.chunked_prefill_size)
        chunked = self.chunked_req
        if chunked is not None:
            chunked.init_next_round_input(self.tree_cache)
            adder.add_chunked_req(chunked)
        if chunked is None or chunked in adder.can_run_list:
            rows_free = self.req_to_token_pool.available_size()
            for req in self.waiting_queue:
                new = len(adder.can_run_list) - (1 if chunked is not None else 0)
                if new >= slots_left or new >= rows_free:
                    break
                req.init_next_round_input(self.tree_cache)
                if adder.add_one_req(req) is not AddResult.CONTINUE:
                    break
        can_run = adder.can_run_list
        if not can_run:
            self._refuse_if_never_fits()
            return None
        if chunked is not None and chunked in can_run:
            self.chunked_req = adder.new_chunked_req
        elif chunked is None:
            self.chunked_req = adder.new_chunked_req
        picked = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in picked]
        for r in can_run:
            r.scheduled_once = True
            r.stage = Stage.CHUNKED if r is self.chunked_req else Stage.RUNNING
        batch = ScheduleBatch(can_run, self.req_to_token_pool, self.allocator, self.kv_pool, self.tree_cache)
        batch.prepare_for_extend()
        return batch

    def _refuse_if_never_fits(self) -> None:
        """With every page and row free, a request at the head that still cannot be admitted never
        will be (validation should prevent this): refuse it rather than spin."""
        if self.running_batch.reqs or self.chunked_req is not None or not self.waiting_queue:
            return
        if (self.allocator.available_size() + self.tree_cache.evictable_size() < self.allocator.capacity
                or self.req_to_token_pool.available_size() < self.req_to_token_pool.size):
            return
        req = self.waiting_queue.pop(0)
        req.finish({"type": "abort", "message": "the request does not fit the KV cache"}, error_status=503)
        logger.error("rid=%s cannot be scheduled even with an empty KV cache; refused", req.rid)
        self.release_req(req)
        self.collect_update(req)

    def update_running_batch(self) -> ScheduleBatch | None:
        batch = self.running_batch
        if not batch.check_decode_mem():
            victims, ratio = batch.retract_decode()
            self.num_retractions += len(victims)
            for v in victims:
                logger.info("rid=%s retracted after %d output tokens (KV memory full)", v.rid,
                            len(v.output_ids))
            self.waiting_queue[:0] = victims
            self.new_token_ratio.on_retract(ratio)
            if not batch.reqs:
                return None
        else:
            self.new_token_ratio.decay()
        batch.prepare_for_decode()
        return batch

    # ================================================================== forward
    def run_batch(self, batch: ScheduleBatch) -> BatchResult:
        fb = batch.forward_batch
        if fb.logits_indices.numel():
            logits = self.runner.forward(fb)
        else:
            # only middle chunks: no logits are needed, the forward just fills the KV
            fb.logits_indices = fb.last_token_indices()[:1]
            self.runner.forward(fb)
            logits = None
        self.forward_ct += 1
        reqs = batch.reqs
        b = len(reqs)
        next_ids: list[int | None] = [None] * b
        lps: list[float | None] = [None] * b
        tops: list[list | None] = [None] * b
        if fb.mode == ForwardMode.DECODE:
            sample_idx = list(range(b))
            rows = list(range(b))
        else:
            sample_idx, rows = [], []
            for i, (r, (_first, count, off), done) in enumerate(
                    zip(reqs, batch.extend_info.rows, batch.extend_info.completes, strict=True)):
                if done and count and len(r.output_ids) < r.max_new_tokens:
                    sample_idx.append(i)
                    rows.append(off + count - 1)
        if sample_idx:
            sreqs = [reqs[i] for i in sample_idx]
            info = SamplingBatchInfo.build([r.sampling for r in sreqs], [r.output_ids for r in sreqs],
                                           logits.shape[-1], [r.generator for r in sreqs], self.eos_token_ids,
                                           prompt_ids=[r.origin_input_ids for r in sreqs])
            want_lp = any(r.return_logprob for r in sreqs)
            nums = [r.top_logprobs_num if r.return_logprob else 0 for r in sreqs] if want_lp else None
            if fb.mode == ForwardMode.DECODE and rows == list(range(logits.shape[0])):
                picked = logits  # every row, in order: no copy (logits are not used after sampling)
            else:
                picked = logits[torch.tensor(rows, dtype=torch.int64)]
            out = self.runner.sample(picked, info, nums, return_logprob=want_lp)
            ids = out.next_token_ids.tolist()
            lp = out.logprobs.tolist() if out.logprobs is not None else None
            for j, i in enumerate(sample_idx):
                next_ids[i] = ids[j]
                if lp is not None and reqs[i].return_logprob:
                    lps[i] = lp[j]
                    if out.top_logprobs is not None:
                        tops[i] = out.top_logprobs[j]
        result = BatchResult(next_ids, lps, tops)
        if fb.mode == ForwardMode.EXTEND:
            self._input_logprobs(batch, logits, result)
        return result

    def _input_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor | None, result: BatchResult) -> None:
        """Logprobs of prompt tokens from this chunk's logits (position p -> token p+1)."""
        b = len(batch.reqs)
        result.input_logprobs = [None] * b
        result.input_top_logprobs = [None] * b
        for i, (r, (first, count, off)) in enumerate(zip(batch.reqs, batch.extend_info.rows, strict=True)):
            if not (r.want_input_logprobs and not r.input_logprobs_done) or logits is None:
                continue
            prompt = r.origin_input_ids
            # positions first..first+count-1; those < len(prompt)-1 predict prompt tokens
            n = max(min(first + count, len(prompt) - 1) - first, 0)
            if n == 0:
                result.input_logprobs[i] = []
                continue
            logp = torch.log_softmax(logits[off : off + n].float(), dim=-1)
            targets = torch.tensor(prompt[first + 1 : first + 1 + n], dtype=torch.int64)
            vals = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            result.input_logprobs[i] = list(zip(vals, targets.tolist(), strict=True))
            if r.top_logprobs_num > 0:
                k = min(r.top_logprobs_num, logp.shape[-1])
                tv, ti = torch.topk(logp, k, dim=-1)
                result.input_top_logprobs[i] = [list(zip(a, c, strict=True))
                                                for a, c in zip(tv.tolist(), ti.tolist(), strict=True)]

    # ================================================================== results
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        if batch.mode == ForwardMode.EXTEND:
            self.process_batch_result_prefill(batch, result)
        else:
            self.process_batch_result_decode(batch, result)

    def _append_token(self, req: Req, i: int, result: BatchResult) -> None:
        tok = result.next_token_ids[i]
        req.output_ids.append(tok)
        if req.return_logprob:
            req.output_logprobs.append((result.token_logprobs[i], tok))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(result.top_logprobs[i] or [])
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.total_generated_tokens += 1

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: BatchResult) -> None:
        for i, req in enumerate(batch.reqs):
            if result.input_logprobs is not None and result.input_logprobs[i] is not None:
                if not req.input_logprobs and req.logprob_start_len == 0:
                    req.input_logprobs.append((None, req.origin_input_ids[0]))
                    req.input_top_logprobs.append(None)
                req.input_logprobs.extend(result.input_logprobs[i])
                tops = result.input_top_logprobs[i]
                req.input_top_logprobs.extend(tops if tops is not None else [None] * len(result.input_logprobs[i]))
            if not batch.extend_info.completes[i]:
                self.tree_cache.cache_unfinished_req(req)
                self.on_prefill_chunk_done(req)
                continue
            req.input_logprobs_done = True
            if req.finished():  # aborted while this batch ran (PD roles abort asynchronously)
                continue
            if result.next_token_ids[i] is not None:
                self._append_token(req, i, result)
            req.check_finished()
            self.on_prefill_done(req)
            if req.finished():
                self.finish_req(req)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.running_batch.merge([req])
            self.collect_update(req)

    def on_prefill_chunk_done(self, req: Req) -> None:
        """Hook: one chunk of the request's prompt is in the KV cache (not the last one)."""

    def on_prefill_done(self, req: Req) -> None:
        """Hook: the request's prefill is complete and its first token appended (if any)."""

    def process_batch_result_decode(self, batch: ScheduleBatch, result: BatchResult) -> None:
        now = time.monotonic()
        self._gen_window.append((now, len(batch.reqs)))
        for i, req in enumerate(batch.reqs):
            if req.finished():
                continue
            self._append_token(req, i, result)
            if req.check_finished():
                self.finish_req(req)
            self.collect_update(req)
        self.running_batch.filter(lambda r: not r.finished())
        if self.forward_ct % 200 == 0:
            s = self.get_stats()
            logger.info("decode: %d running, %d waiting, kv used %d/%d, evictable %d, gen %.1f tok/s, "
                        "new_token_ratio %.3f", s["num_running_reqs"], s["num_waiting_reqs"],
                        s["num_tokens_used"], s["kv_total_tokens"], s["kv_evictable_tokens"],
                        s["gen_throughput"], self.new_token_ratio.value)

    def finish_req(self, req: Req) -> None:
        """A request ended normally: release its memory (into the cache) and forget it."""
        self.release_req(req)
        logger.info("rid=%s finished: %s, prompt %d, completion %d, cached %d", req.rid, req.finished_reason,
                    len(req.origin_input_ids), len(req.output_ids), req.cached_tokens)

    def release_req(self, req: Req) -> None:
        """Hook: free (or cache) a finished request's memory."""
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        elif req.last_node is not None:
            req.last_node = None
        self.total_cached_tokens += req.cached_tokens if req.scheduled_once else 0
        self.live_reqs.pop(req.rid, None)

    def add_prebuilt_reqs(self, reqs: list[Req]) -> None:
        """Requests whose KV is already in the pool join the running batch without prefill."""
        for req in reqs:
            if req.req_pool_idx is None or req.kv_len != len(req.origin_input_ids) or not req.output_ids:
                raise ValueError(f"rid={req.rid}: a prebuilt request needs a req pool row, its prompt's "
                                 "KV and its first output token")
            req.input_logprobs_done = True
            req.scheduled_once = True
            self.live_reqs.setdefault(req.rid, req)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.check_finished():
                self.finish_req(req)
            else:
                self.running_batch.merge([req])
            self.collect_update(req)

    # ================================================================== output
    def collect_update(self, req: Req) -> None:
        """Queue the request's news for this iteration's BatchOut (streaming respects
        stream_interval; non-streaming requests report once, when they finish)."""
        done = req.finished()
        new = len(req.output_ids) - req.sent_token_offset
        if not done:
            if not req.stream or new <= 0:
                return
            if req.sent_token_offset > 0 and new < self.args.stream_interval:
                return
        if req.rid in self._update_rids:
            # one update per request per iteration: drop the earlier one and resend from its offset
            self._updates = [u for u in self._updates if u.rid != req.rid]
        upd = ReqUpdate(
            rid=req.rid,
            new_token_ids=req.output_ids[req.sent_token_offset:],
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            finish_reason=req.finished_reason,
            error_status=req.error_status,
        )
        if req.return_logprob:
            upd.output_logprobs = req.output_logprobs[req.sent_token_offset:]
            if req.top_logprobs_num > 0:
                upd.output_top_logprobs = req.output_top_logprobs[req.sent_token_offset:]
            if req.want_input_logprobs and req.input_logprobs_done and not req.sent_input_logprobs:
                upd.input_logprobs = req.input_logprobs
                if req.top_logprobs_num > 0:
                    upd.input_top_logprobs = req.input_top_logprobs
        self._updates.append(upd)
        self._update_rids.add(req.rid)
        self._pending_offsets[req.rid] = (req, len(req.output_ids))

    def stream_output(self) -> None:
        """Send this iteration's updates as one BatchOut."""
        if not self._updates:
            return
        for req, offset in self._pending_offsets.values():
            req.sent_token_offset = offset
            if req.input_logprobs_done:
                req.sent_input_logprobs = True
        out = BatchOut(updates=self._updates)
        self._updates = []
        self._update_rids = set()
        self._pending_offsets = {}
        self.send(out)

    def send(self, msg) -> None:
        if self.send_fn is not None:
            self.send_fn(msg)

    # ================================================================== loop
    def step(self) -> bool:
        """One scheduling iteration without receiving; returns whether a forward ran."""
        self.process_queues()
        batch = self.get_next_batch_to_run()
        ran = batch is not None
        if ran:
            result = self.run_batch(batch)
            self.process_batch_result(batch, result)
        self.stream_output()
        return ran

    def recv_requests(self, timeout_ms: int) -> list:
        return self.comm.recv(timeout_ms) if self.comm is not None else []

    def event_loop(self) -> None:
        ran = False
        while not self.stopping:
            # block on the socket when there is nothing to do; when there is work that could not
            # run last time (waiting on memory or on a transfer), wait a little instead of spinning
            if not self.has_work():
                timeout = self.idle_poll_ms
            else:
                timeout = 0 if ran else self.busy_poll_ms
            msgs = self.recv_requests(timeout)
            if msgs is None:  # the communicator says stop
                break
            self.process_input_requests(msgs)
            if self.has_work():
                ran = self.step()
            else:
                ran = False
                self.stream_output()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """In-process driving: step until nothing is left to do."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")

    # ================================================================== cache / stats
    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        ok = self.tree_cache.flush()
        logger.info("cache flush: %s", "done" if ok else "refused (locked nodes)")
        return ok

    def queue_counts(self) -> dict[str, int]:
        """Hook: requests per stage queue."""
        return {"waiting": len(self.waiting_queue), "running": len(self.running_batch.reqs),
                "chunked": 1 if self.chunked_req is not None else 0}

    def get_stats(self) -> dict[str, Any]:
        free = self.allocator.available_size()
        total = self.allocator.capacity
        evictable = self.tree_cache.evictable_size()
        now = time.monotonic()
        while self._gen_window and now - self._gen_window[0][0] > 10.0:
            self._gen_window.popleft()
        if len(self._gen_window) >= 2:
            span = max(now - self._gen_window[0][0], 1e-3)
            gen = sum(n for _, n in self._gen_window) / span
        else:
            gen = 0.0
        return {
            "num_running_reqs": len(self.running_batch.reqs) + (1 if self.chunked_req is not None else 0),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_queue_reqs": self.queue_counts(),
            "kv_free_tokens": free,
            "kv_total_tokens": total,
            "kv_evictable_tokens": evictable,
            "req_slots_free": self.req_to_token_pool.available_size(),
            "req_slots_total": self.req_to_token_pool.size,
            "cache_hit_rate": self.total_cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0,
            "num_tokens_used": total - free - evictable,
            "gen_throughput": gen,
            "new_token_ratio": self.new_token_ratio.value,
            "num_retractions": self.num_retractions,
            "forward_ct": self.forward_ct,
            "total_generated_tokens": self.total_generated_tokens,
            "radix_cache": self.tree_cache.enabled,
            "page_size": self.page_size,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            **(self.runner.hybrid.stats() if hasattr(self.runner, "hybrid") else {}),
        }
