"""Scheduler: the requests of one TP rank, with the contract of vLLM's scheduler (reference 002).

Contract
* `add_request(req)`: a new request joins the waiting queue; `add_prebuilt_reqs(reqs)`: requests whose
  prompt KV is already in the pool (a decode node's received KV) join the running batch;
* `schedule() -> SchedulerOutput`: a prefill batch if any waiting request can be admitted (the
  request being chunked goes first; with `decode_between_chunks`, a decode node's, the running batch
  decodes one step between two chunks), else one decode step of the running batch (retracting requests
  when KV memory runs out), else no batch;
* `update_from_output(out, runner_output) -> BatchOut | None`: append the sampled tokens and logprobs,
  check stops, release finished requests' memory (into the radix cache); returns the iteration's
  per-request updates (`common/scheduler/output.py`), every end reported exactly once;
* `finish_requests(ids, status)`: end requests wherever they are and free their memory (unknown or
  already ended ids are skipped); `release_held(rid)`: end a request whose memory a role held;
* `get_request_counts() -> (running, waiting)`, `has_unfinished_requests()`.

One engine step: `out = schedule()`, `result = runner.run(out.batch)` (`common/runner.py`: forward,
sampling, logprobs), `emit(update_from_output(out, result))`. With overlap scheduling
(`--enable-overlap-schedule`, TP 1) a decode step's forward runs on a worker thread and the loop goes on: it receives requests and builds the next step, then
processes this step's result (`common/scheduler/overlap.py` says what waits for what). Around it `event_loop` receives the front
end's messages: new requests (validated; refused with error_status 400 when they cannot fit), aborts,
stats queries, cache flushes. Without a communicator (`comm=None`) the scheduler is driven in
process: `process_input_requests([...])`, `step()`, and `send_fn` receives what it sends.

A node role plugs in through `hooks` (`common/scheduler/hooks.py`). An exception in a hook never
ends the loop: a per-request hook's failure ends that request with error_status 500 (one log
record with the rid and the traceback); `before_schedule` and `stats` failures are logged and the
loop goes on; `on_release` failures are logged and the release completes.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from common import core_loan
from common.config import ServerArgs
from common.forward_batch import ForwardMode
from common.grammar import GrammarCompiler
from common.histogram import BucketCounts
from common.kv_events import KVEventPublisher, KVEventsConfig
from common.memory.radix_cache import make_tree_cache
from common.protocol import (
    AbortRequest,
    BatchOut,
    FlushCacheRequest,
    StatsQuery,
    StatsReport,
    TokenizedRequest,
)
from common.runner import RunnerOutput
from common.scheduler.batch import ScheduleBatch
from common.scheduler.grammar_queue import GrammarQueue
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.intake import Admission, check_request, fast_tokenizer, load_stop_decoder, make_req
from common.scheduler.offload import make_host_store, offload_victim, restore
from common.scheduler.output import OutputBatcher
from common.scheduler.overlap import OverlapRunner, overlap_choice
from common.scheduler.policy import NewTokenRatio, SchedulePolicy
from common.scheduler.prefill_adder import AddResult, PrefillAdder
from common.scheduler.priority import PriorityScheduling
from common.scheduler.req import FinishStatus, Req, Stage
from common.scheduler.speculative import DraftLayerDrafter, NgramDrafter, accepted_run, rollback
from common.scheduler.stats import scheduler_stats
from common.scheduler.trace import export_stage_spans, make_tracer

logger = logging.getLogger("scheduler")


@dataclass
class SchedulerOutput:
    """What `schedule()` decided: the batch to run (None: nothing to run) and the rids it retracted."""

    batch: ScheduleBatch | None = None
    retracted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, args: ServerArgs, model_dir: str, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, *, runner=None, tokenizer: Any = None,
                 send_fn: Callable[[Any], None] | None = None, comm=None, dp_rank: int = 0,
                 pp_rank: int = 0) -> None:
        self.args = args
        self.model_dir = model_dir
        self.dp_rank = dp_rank  # the DP group this scheduler is (--dp-size)
        self.pp_rank = pp_rank  # its pipeline stage (--pp-size): every stage schedules alike
        first = tp_rank == 0 and pp_rank == 0  # the rank that speaks for the group
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        if runner is None:
            from common.runner import ModelRunner

            runner = ModelRunner(args, model_dir, tp_rank, tp_size, tp_group, pp_rank=pp_rank, dp_rank=dp_rank)
        self.runner = runner
        self.model_config = runner.model_config
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
        self.tracer = make_tracer(args) if first else None  # stage spans of released requests
        self.queue_time = BucketCounts()  # arrival to first prefill (the role's queues included)
        self.kv_events = None  # publishes the prefix cache's blocks (rank 0 only: the ranks' caches are equal)
        if getattr(args, "kv_events_config", None) and self.tree_cache.enabled and first:
            cfg = KVEventsConfig.parse(args.kv_events_config, args.host, args.dp_size).for_dp_rank(dp_rank)
            if cfg.enabled:
                self.kv_events = self.tree_cache.events = KVEventPublisher(
                    cfg, self.page_size, dp_rank if args.dp_size > 1 else None,
                    sliding_window=getattr(getattr(runner, "hybrid", None), "window", None))
        self.tokenizer = tokenizer if tokenizer is not None else load_stop_decoder(args.tokenizer or model_dir)
        self.priority = PriorityScheduling(args)  # --schedule-policy priority: order, preemption, full queue
        self.policy = SchedulePolicy(args.schedule_policy, self.tree_cache, self.priority)
        self.new_token_ratio = NewTokenRatio(args.init_new_token_ratio, args.min_new_token_ratio,
                                             args.new_token_ratio_decay_steps)
        self.hooks = SchedulerHooks()

        # every request from arrival to its end, by rid; where it is: `req.stage`
        self.live_reqs: dict[str, Req] = {}
        self.waiting_queue: list[Req] = []  # Stage.WAITING
        self.chunked_req: Req | None = None  # Stage.CHUNKED
        # a decode node sets this: the running batch decodes one step after each chunk of a prompt
        self.decode_between_chunks = False
        self._chunk_scheduled = False  # the last batch scheduled was a chunk of an unfinished prompt
        self.running_batch = ScheduleBatch([], self.req_to_token_pool, self.allocator, self.kv_pool,
                                           self.tree_cache)  # Stage.RUNNING
        self.held: dict[str, Req] = {}  # finished, memory held for the role (hooks.on_finished)
        self.output = OutputBatcher(args.stream_interval)
        # retracted requests' KV waits here until they resume (--decode-offload-size; None: off)
        self.host_store = make_host_store(args, self)
        self.admission = Admission(args.queued_requests_limit)  # --max-queued-requests
        # requests whose grammar compiles (Stage.NEW, admitted when it is ready)
        tok_path = args.tokenizer or model_dir
        self.grammar_queue = GrammarQueue(lambda: GrammarCompiler(tok_path, self.vocab_size, self.eos_token_ids,
                                                                  fast_tokenizer(self.tokenizer)),
                                          tp_size * getattr(args, "pp_size", 1))

        # the prefill node lends its cores to its decode node while it has nothing to run (common/core_loan.py)
        self.lender, self.borrower = core_loan.for_node(args, tp_rank)

        # decode forwards on a worker thread (None: in sequence); common/scheduler/overlap.py
        overlap, why = overlap_choice(args, tp_size)
        self.overlap = OverlapRunner(runner, args.max_running_requests + 8) if overlap else None
        if tp_rank == 0:
            logger.info("overlap scheduling %s", why)

        # --speculative-algorithm NGRAM: decode steps verify drafts (common/scheduler/speculative.py)
        self.drafter = None
        if args.speculative_algorithm:
            if args.draft_layers:  # EAGLE / MTP: the runner drafts with the checkpoint's draft layers
                self.drafter = DraftLayerDrafter(args.speculative_num_draft_tokens,
                                                 args.speculative_disable_by_batch_size)
            else:
                self.drafter = NgramDrafter(args.speculative_num_draft_tokens,
                                            args.speculative_ngram_min_match_window_size,
                                            args.speculative_ngram_max_match_window_size,
                                            args.speculative_disable_by_batch_size)

        self.send_fn = send_fn
        self.comm = comm
        self.stopping = False
        self.idle_poll_ms = 500
        self.busy_poll_ms = 2

        # statistics
        self.forward_ct = 0
        self.num_retractions = 0
        self.num_retract_offloaded = 0  # victims whose KV went to the host store
        self.num_retract_restored = 0  # resumed with their KV copied back (no prefill)
        self.num_retract_recomputed = 0  # resumed by prefilling prompt + output again (no entry: the fallback)
        self.num_mixed_steps = 0  # prefill forwards the running requests decoded in (--enable-mixed-chunk)
        self.total_prefill_tokens = 0  # tokens computed by prefill (extend) forwards
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.total_generated_tokens = 0
        self._gen_window: collections.deque[tuple[float, int]] = collections.deque()

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's EOS tokens: they end requests here and are masked by min_new_tokens in the runner."""
        return self.runner.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.runner.eos_token_ids = list(ids)

    # ================================================================== contract
    def add_request(self, req: Req) -> None:
        """A new request (or one a role held since it arrived) joins the waiting queue."""
        known = self.live_reqs.get(req.rid)
        if (known is not None and known is not req) or req.stage is not Stage.NEW:
            raise ValueError(f"rid={req.rid} is already live here")
        self.live_reqs[req.rid] = req
        req.stage = Stage.WAITING
        req.mark("waiting")
        self.waiting_queue.append(req)

    def add_prebuilt_reqs(self, reqs: list[Req]) -> None:
        """Requests whose prompt KV is already in the pool join the running batch without prefill:
        each has `req_pool_idx`, `kv_len` = prompt length and `output_ids` = [first token]."""
        for req in reqs:
            if req.req_pool_idx is None or req.kv_len != len(req.origin_input_ids) or not req.output_ids:
                raise ValueError(f"rid={req.rid}: a prebuilt request needs a req pool row, its prompt's "
                                 "KV and its first output token")
            if self.live_reqs.setdefault(req.rid, req) is not req:
                raise ValueError(f"rid={req.rid} is already live here")
            req.input_logprobs_done = True
            req.scheduled_once = True
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.check_finished():
                self._finish(req)
            else:
                self.running_batch.merge([req])
                req.mark("decode")
            self._report(req)

    def schedule(self) -> SchedulerOutput:
        """The role moves its queues on first; then a prefill batch, else a decode step, else nothing (with
        `decode_between_chunks`, a decode step comes between two chunks of a prompt)."""
        try:
            self.hooks.before_schedule()
        except Exception:
            logger.exception("before_schedule hook failed; the loop goes on")
        self.grammar_queue.poll(self._start_request, self._grammar_failed)
        if self.overlap is not None:
            self.overlap.before_building(self)
        out = SchedulerOutput()
        decode_turn = self.decode_between_chunks and self._chunk_scheduled and bool(self.running_batch.reqs)
        out.batch = None if decode_turn else self._prefill_batch()
        mixed = out.batch is not None and self._mix_running(out.batch)
        self._chunk_scheduled = out.batch is not None and self.chunked_req is not None and not mixed
        if out.batch is None and self.running_batch.reqs:
            out.batch = self._decode_batch(out)
        return out

    def _mix_running(self, batch: ScheduleBatch) -> bool:
        """--enable-mixed-chunk: the running requests decode their next token in this prefill forward, if
        the KV memory for it is free (else they decode, or retract, in a step of their own next)."""
        running = self.running_batch
        if not (self.args.enable_mixed_chunk and running.reqs and running.check_decode_mem()):
            return False
        batch.mix_with_running(list(running.reqs))
        self.new_token_ratio.decay()
        self.num_mixed_steps += 1
        return True

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput | None) -> BatchOut | None:
        """Apply what the runner produced for `out.batch`; returns every update of this iteration
        (the input's refusals and aborts included), one per request, or None."""
        batch = out.batch
        if batch is not None:
            self.forward_ct += 1
            if batch.mode == ForwardMode.EXTEND:
                self._update_prefill(batch, result)
            else:
                self._update_decode(batch, result)
        return self.output.take()

    def finish_requests(self, request_ids: str | Iterable[str], status: FinishStatus) -> None:
        """End requests now, wherever they are, free their memory and report their end. Unknown ids
        and requests that already ended are skipped, so finishing twice is harmless."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            req = self.live_reqs.get(rid)
            if req is None:
                continue
            if status.reason.get("type") == "abort":
                logger.info("rid=%s aborted (%s) at stage %s", rid, status.reason.get("message"), req.stage.value)
                req.to_abort = status.reason.get("message")
            self._dequeue(req)
            req.finish(status.reason, error_status=status.error_status)
            self._release(req)
            if status.reason.get("type") != "abort":
                self._log_finished(req)
            self._report(req)

    def _dequeue(self, req: Req) -> None:
        """Take a request out of the queue its stage says holds it (Stage.NEW: a role's queue, which
        `on_release` empties)."""
        if req.stage is Stage.WAITING:
            self.waiting_queue.remove(req)
        elif req.stage is Stage.NEW and req.grammar is None and req.sampling.grammar() is not None:
            self.grammar_queue.remove(req)
        elif req.stage is Stage.CHUNKED:
            self.chunked_req = None
        elif req.stage is Stage.RUNNING:
            self.running_batch.filter(lambda r: r is not req)
        elif self.held.pop(req.rid, None) is not None:
            req.finished_reason = None  # not reported yet: it ends the new way, not the way it had finished

    def release_held(self, rid: str) -> None:
        """The role is done with a request it held after it finished: free its memory, report its end."""
        req = self.held.pop(rid)
        self._release(req)
        self._log_finished(req)
        self._report(req)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting): the running batch and the request being chunked; the waiting queue."""
        return self.num_running_slots_used(), len(self.waiting_queue)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, being chunked or running (not those only a role holds)."""
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req is not None)

    # ================================================================== input
    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedRequest):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortRequest):
                self.abort_request(msg.rid, msg.message)
            elif isinstance(msg, StatsQuery):
                self._send_admitted()
                self.send(StatsReport(qid=msg.qid, stats=self.get_stats()))
            elif isinstance(msg, FlushCacheRequest):
                ok = self.flush_cache()
                self._send_admitted()
                self.send(StatsReport(qid=msg.qid, stats={"flushed": ok, **self.get_stats()}))
            else:
                logger.warning("unknown message %r", type(msg).__name__)
        self._send_admitted()  # at once, not after this iteration's forward: streams start their answer on it

    def _send_admitted(self) -> None:
        """The rids admitted since the last such message. Also sent before every stats report, so the
        front end has read each admission the stats count by the time it reads them: its own count of
        requests still in the pipe and the scheduler's queue then agree (a full queue in the stats is
        full for the front end's guard too)."""
        admitted = self.admission.take_admitted()
        if admitted:
            self.send(BatchOut(updates=[], admitted=admitted))

    def make_req(self, msg: TokenizedRequest) -> Req:
        return make_req(msg, self.eos_token_ids, self.tokenizer)

    def handle_generate_request(self, msg: TokenizedRequest) -> None:
        req = self.make_req(msg)
        full = self.admission.check(msg, self.num_queued_reqs)
        # a full queue turns away its lowest priority first: a newcomer that outranks it takes its place
        displaced = self.priority.queue_full_victim(self, req) if full is not None and msg.batch_size <= 1 else None
        if full is not None and displaced is None:
            self.finish_refused(req, *full)
            return
        if msg.rid in self.live_reqs:
            self.finish_refused(req, 400, f"a request with rid {msg.rid!r} is already running")
            return
        try:
            err = self.hooks.validate(req) or self.validate_request(req)
        except Exception:
            logger.exception("rid=%s validate hook failed; the request is refused", req.rid)
            err = (500, "internal error while validating the request (see the node's log)")
        if err is not None:
            self.finish_refused(req, *err)
            return
        if displaced is not None:
            self.priority.displace(self, displaced, req)
        self.live_reqs[req.rid] = req
        self.total_prompt_tokens += len(req.origin_input_ids)
        logger.info("rid=%s received: %d prompt tokens, max_new_tokens=%d, priority=%d", req.rid,
                    len(req.origin_input_ids), req.max_new_tokens, req.priority)
        if req.sampling.grammar() is not None:
            self.grammar_queue.add(req)  # admitted once its grammar is ready
            return
        self._start_request(req)

    def _start_request(self, req: Req) -> None:
        """An accepted request goes to its role's queues (or the waiting queue) and is admitted."""
        try:
            kept = self.hooks.on_new_request(req)
        except Exception:
            self._hook_failed("on_new_request", req)
            return
        if not kept:
            self.add_request(req)
        self.admission.admitted(req.rid)

    def _grammar_failed(self, req: Req, message: str) -> None:
        self.live_reqs.pop(req.rid, None)
        self.finish_refused(req, 400, message)

    def _hook_failed(self, hook: str, req: Req) -> None:
        """A role hook raised for `req` (call from the except block): log it and end that request
        with 500, wherever it is (a reason it had already finished with is replaced)."""
        logger.exception("rid=%s %s hook failed; the request fails", req.rid, hook)
        req.finished_reason = None
        self.finish_requests(req.rid, FinishStatus.abort(f"internal error in the node's {hook} (see its log)", 500))

    def validate_request(self, req: Req) -> tuple[int, str] | None:
        """(HTTP status, message) when the request cannot be served here, else None."""
        return check_request(req, self.vocab_size, self.context_length, self.allocator.capacity, self.tokenizer,
                             self.args.max_top_logprobs_num)

    def finish_refused(self, req: Req, status: int, message: str, err_type: str | None = None) -> None:
        """End a request that will not be served here; `err_type` names a cause a router acts on."""
        logger.info("rid=%s refused (%d): %s", req.rid, status, message)
        req.finish(FinishStatus.abort(message, err_type=err_type).reason, error_status=status)
        self._report(req)

    def abort_request(self, rid: str, message: str = "aborted by client") -> None:
        """The front end's abort: one request, or every live one for rid ""."""
        self.finish_requests(list(self.live_reqs) if rid == "" else [rid], FinishStatus.abort(message))

    def num_queued_reqs(self) -> int:
        """Requests here that are not running yet (--max-queued-requests counts them): the waiting queue
        (retracted requests included) and those a role keeps in its own queues before they run."""
        return len(self.waiting_queue) + sum(1 for r in self.live_reqs.values() if r.stage is Stage.NEW)

    # ================================================================== scheduling
    def num_running_slots_used(self) -> int:
        """The running batch, the request being chunked, and ended requests whose memory waits for a
        forward in flight (overlap scheduling)."""
        held = self.overlap.num_deferred() if self.overlap is not None else 0
        return len(self.running_batch.reqs) + (1 if self.chunked_req is not None else 0) + held

    def _prefill_batch(self) -> ScheduleBatch | None:
        if self.chunked_req is None and not self.waiting_queue:
            return None
        slots_left = self.max_running_requests - self.num_running_slots_used()
        if self.chunked_req is None and slots_left <= 0 and not self.priority.preemption:
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
            preempted: list[Req] = []  # running requests retracted for higher-priority ones (--enable-priority-preemption)
            prompts: set[int] = set()  # hashes of the prompts this batch prefills
            for req in self.waiting_queue:
                new = len(adder.can_run_list) + len(adder.restore_list) - (1 if chunked is not None else 0)
                if new >= slots_left or new >= rows_free:
                    victims = self.priority.preempt(self, adder, req, slot=True)
                    if not victims:
                        break
                    preempted += victims
                    slots_left, rows_free = slots_left + len(victims), rows_free + len(victims)
                if self.host_store is not None and req.rid in self.host_store:
                    added = adder.add_restored_req(req, self.host_store.kv_len(req.rid))
                else:
                    req.init_next_round_input(self.tree_cache)
                    if self._shares_a_prompt_in(req, prompts):
                        continue  # it takes that prompt's KV from the cache next round instead of computing it again
                    preempted += self.priority.preempt(self, adder, req, slot=False)  # if its prompt + output do not fit
                    added = adder.add_one_req(req)
                if added is not AddResult.CONTINUE:
                    break
            self.waiting_queue += preempted  # the policy orders them by priority next round
        can_run = adder.can_run_list
        restored = adder.restore_list
        if restored:  # back into the running batch now; they decode with the next decode step
            picked = set(map(id, restored))
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in picked]
            for r in restored:
                restore(self, r)
                r.mark("decode")
        if not can_run:
            if not restored:
                self._refuse_if_never_fits()
            return None
        if chunked is None or chunked in can_run:
            self.chunked_req = adder.new_chunked_req
        picked = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in picked]
        for r in can_run:
            if r.is_retracted and r is not chunked:  # leaves the waiting queue to prefill prompt + output again
                self.num_retract_recomputed += 1
            if not r.scheduled_once:
                self.queue_time.observe(max(0.0, time.time() - r.arrival_time))
            r.scheduled_once = True
            r.stage = Stage.CHUNKED if r is self.chunked_req else Stage.RUNNING
            r.mark("prefill")
        batch = ScheduleBatch(can_run, self.req_to_token_pool, self.allocator, self.kv_pool, self.tree_cache)
        batch.prepare_for_extend()
        self.total_prefill_tokens += sum(r.extend_input_len for r in can_run)
        return batch

    def _shares_a_prompt_in(self, req: Req, prompts: set[int]) -> bool:
        """Whether `req`'s prompt is one this batch already prefills (the copies of a request with n > 1,
        or clients sending the same prompt together): with the prefix cache on, it waits one round and
        then finds the prompt's KV cached. Records the prompt of a request that is not deferred."""
        if not self.tree_cache.enabled or req.is_retracted or req.extend_input_len <= self.page_size:
            return False
        key = hash(tuple(req.origin_input_ids))
        if key in prompts:
            return True
        prompts.add(key)
        return False

    def _refuse_if_never_fits(self) -> None:
        """With every page and row free, a request at the head that still cannot be admitted never
        will be (validation should prevent this): refuse it rather than spin."""
        if self.running_batch.reqs or self.chunked_req is not None or not self.waiting_queue:
            return
        if (self.allocator.available_size() + self.tree_cache.evictable_size() < self.allocator.capacity
                or self.req_to_token_pool.available_size() < self.req_to_token_pool.size):
            return
        req = self.waiting_queue[0]
        logger.error("rid=%s cannot be scheduled even with an empty KV cache; refused", req.rid)
        self.finish_requests(req.rid, FinishStatus.abort("the request does not fit the KV cache", 503))

    def _decode_batch(self, out: SchedulerOutput) -> ScheduleBatch | None:
        batch = self.running_batch
        if not batch.check_decode_mem():
            store = self.host_store
            victims, ratio = batch.retract_decode(before_release=(lambda r: offload_victim(self, r)) if store is not None else None,
                                                  order_key=self.priority.retract_key if self.priority.enabled else None)
            self.num_retractions += len(victims)
            for v in victims:
                v.mark("waiting")  # retracted
                kept = store is not None and v.rid in store
                logger.info("rid=%s retracted after %d output tokens (KV memory full); %s", v.rid,
                            len(v.output_ids), "KV in the host store" if kept else "will prefill again")
            out.retracted = [v.rid for v in victims]
            self.waiting_queue[:0] = victims
            self.new_token_ratio.on_retract(ratio)
            if not batch.reqs:
                return None
        else:
            self.new_token_ratio.decay()
        if self.overlap is None:
            if self.drafter is not None:
                drafts = self.drafter.drafts_for(batch.reqs, self.context_length)
                # drafts only take free pages: a short pool decodes plainly rather than evict or retract
                if any(drafts) and batch.verify_pages_needed(drafts) <= self.allocator.available_pages():
                    batch.prepare_for_verify(drafts)
                    return batch
            batch.prepare_for_decode()
            return batch
        batch = self.overlap.decode_batch_ahead(batch)
        if batch is not None:
            batch.prepare_for_decode(self.overlap.pending_token)
        return batch

    # ================================================================== results
    def _append_token(self, req: Req, tok: int, logprob: float | None = None, top=None) -> None:
        req.output_ids.append(tok)
        if req.grammar is not None:
            req.accept_grammar(tok)
        if req.return_logprob:
            req.output_logprobs.append((logprob, tok))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(top or [])
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.total_generated_tokens += 1

    def _update_prefill(self, batch: ScheduleBatch, result: RunnerOutput) -> None:
        n = batch.extend_info.num_prefill
        for i, req in enumerate(batch.reqs[:n]):
            if result.input_logprobs is not None and result.input_logprobs[i] is not None:
                if not req.input_logprobs and req.logprob_start_len == 0:
                    req.input_logprobs.append((None, req.origin_input_ids[0]))
                    req.input_top_logprobs.append(None)
                req.input_logprobs.extend(result.input_logprobs[i])
                tops = result.input_top_logprobs[i]
                req.input_top_logprobs.extend(tops if tops is not None else [None] * len(result.input_logprobs[i]))
            if not batch.extend_info.completes[i]:
                self.tree_cache.cache_unfinished_req(req)
                try:
                    self.hooks.on_chunk_done(req)
                except Exception:
                    self._hook_failed("on_chunk_done", req)
                continue
            req.input_logprobs_done = True
            if req.finished():  # ended while this batch ran
                continue
            if result.next_token_ids[i] is not None:
                self._append_token(req, result.next_token_ids[i], result.token_logprobs[i], result.top_logprobs[i])
            req.check_finished()
            try:
                self.hooks.on_prefill_done(req)
            except Exception:
                self._hook_failed("on_prefill_done", req)
                continue
            if req.finished():
                self._finish(req)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.running_batch.merge([req])
                req.mark("decode")
            self._report(req)
        if n < len(batch.reqs):  # a mixed chunk's decode rows
            self._update_decode(batch, result, start=n)

    def _update_decode(self, batch: ScheduleBatch, result: RunnerOutput, start: int = 0) -> None:
        """A decode step's tokens (or a verify step's, or a mixed chunk's decode rows from `start` on)."""
        before = self.total_generated_tokens
        if batch.mode == ForwardMode.VERIFY:
            self._update_verify(batch, result)
        else:
            for i in range(start, len(batch.reqs)):
                req = batch.reqs[i]
                if req.finished():
                    continue
                self._append_token(req, result.next_token_ids[i], result.token_logprobs[i], result.top_logprobs[i])
                if req.check_finished():
                    self._finish(req)
                self._report(req)
        self._gen_window.append((time.monotonic(), self.total_generated_tokens - before))
        self.running_batch.filter(lambda r: not r.finished())
        if self.forward_ct % 200 == 0:
            s = self.get_stats()
            logger.info("decode: %d running, %d waiting, kv used %d/%d, evictable %d, gen %.1f tok/s, "
                        "new_token_ratio %.3f", s["num_running_reqs"], s["num_waiting_reqs"],
                        s["num_tokens_used"], s["kv_total_tokens"], s["kv_evictable_tokens"],
                        s["gen_throughput"], self.new_token_ratio.value)

    def _update_verify(self, batch: ScheduleBatch, result: RunnerOutput) -> None:
        """Keep each request's confirmed drafts and its own next token, up to where it finishes, and give
        back the KV slots of the rest."""
        kept = []
        r2t = self.req_to_token_pool.req_to_token
        for i, (req, drafts) in enumerate(zip(batch.reqs, batch.drafts, strict=True)):
            if req.finished():
                kept.append(0)
                continue
            reserved = req.kv_len
            base = reserved - 1 - len(drafts)  # KV length before this step
            targets = result.next_token_ids[i]
            lps, tops = result.token_logprobs[i], result.top_logprobs[i]
            n = 0
            for j in range(accepted_run(drafts, targets) + 1):
                self._append_token(req, targets[j], lps[j] if lps else None, tops[j] if tops else None)
                n += 1
                if req.check_finished():
                    break
            req.kv_len = base + n
            rollback(req, self.allocator, r2t, reserved)
            kept.append(n)
        hybrid = getattr(self.runner, "hybrid", None)
        if hybrid is not None:  # recurrent state: the one after each running request's last kept token
            hybrid.keep_verified(batch.forward_batch, [0 if r.finished() else n for r, n in zip(batch.reqs, kept,
                                                                                                   strict=True)])
        for req, n in zip(batch.reqs, kept, strict=True):
            if n:
                if req.finished():
                    self._finish(req)
                self._report(req)
        self.drafter.record(batch.reqs, batch.drafts, kept)

    def _finish(self, req: Req) -> None:
        """A request ended normally: the role may hold it; else release its memory (into the cache)."""
        try:
            hold = self.hooks.on_finished(req)
        except Exception:
            logger.exception("rid=%s on_finished hook failed; the request fails", req.rid)
            req.finished_reason = None
            req.finish({"type": "abort", "message": "internal error in the node's on_finished (see its log)"},
                       error_status=500)
            hold = False
        if hold:
            self.held[req.rid] = req
            return
        self._release(req)
        self._log_finished(req)

    def _log_finished(self, req: Req) -> None:
        logger.info("rid=%s finished: %s, prompt %d, completion %d, cached %d", req.rid, req.finished_reason,
                    len(req.origin_input_ids), len(req.output_ids), req.cached_tokens)

    def _release(self, req: Req) -> None:
        """Free (or cache) an ended request's memory, the role's share first, and forget it. Memory
        a forward in flight still writes is freed once that forward is done."""
        if self.overlap is not None and self.overlap.in_flight(req):
            self.overlap.defer(req, self._free_memory)
        else:
            self._free_memory(req)
        self.total_cached_tokens += req.cached_tokens if req.scheduled_once else 0
        self.live_reqs.pop(req.rid, None)
        if self.tracer is not None and req.traceparent:
            export_stage_spans(self.tracer, req)

    def _free_memory(self, req: Req) -> None:
        try:
            self.hooks.on_release(req)
        except Exception:
            logger.exception("rid=%s on_release hook failed; the scheduler frees its own share", req.rid)
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        elif req.last_node is not None:
            req.last_node = None
        if self.host_store is not None:
            self.host_store.discard(req.rid)

    def _report(self, req: Req) -> None:
        """Record the request's news for this iteration's BatchOut (a held request's end waits)."""
        if req.rid not in self.held:
            self.output.add(req)

    # ================================================================== loop
    def emit(self, out: BatchOut | None) -> None:
        if out is not None:
            self.send(out)

    def stream_output(self) -> None:
        """Send what this iteration recorded so far: refusals and aborts when no step ran; before a
        forward, what the schedule recorded (a prefill node's request whose transfer is done, a decode
        node's first token from the prefill node, a failed transfer), so it does not wait a forward."""
        self.emit(self.output.take())

    def send(self, msg) -> None:
        if self.send_fn is not None:
            self.send_fn(msg)

    def before_forward(self) -> None:
        """A forward is about to run (or launch): what the schedule recorded goes out first (see
        `stream_output`), the prefill node stops lending its cores, the decode node borrows them if lent."""
        self.stream_output()
        if self.lender is not None:
            self.lender.set_idle(False)
        if self.borrower is not None:
            self.borrower.before_forward()

    def step(self) -> bool:
        """One engine step (after the input); returns whether a forward ran (or was launched)."""
        if self.overlap is not None:
            return self.overlap.step(self)
        out = self.schedule()
        if out.batch is None:
            self.emit(self.update_from_output(out, None))
            return False
        self.before_forward()
        result = self.runner.run(out.batch)
        if self.borrower is not None:
            self.borrower.after_forward()
        self.emit(self.update_from_output(out, result))
        return True

    def has_work(self) -> bool:
        return (self.has_unfinished_requests() or self.hooks.has_work() or bool(self.grammar_queue)
                or (self.overlap is not None and self.overlap.busy()))

    def recv_requests(self, timeout_ms: int) -> list:
        return self.comm.recv(timeout_ms) if self.comm is not None else []

    def event_loop(self, beat=None) -> None:
        """Serve until told to stop; `beat()` (the watchdog's) runs once per iteration."""
        ran = False
        try:
            while not self.stopping:
                if beat is not None:
                    beat()
                # block on the socket when there is nothing to do; right after a forward, with more
                # forwards to run, do not wait at all; otherwise (waiting on memory or on a transfer)
                # wait a little instead of spinning on the CPU the forwards need
                if not self.has_work():
                    timeout = self.idle_poll_ms
                elif ran and (self.has_unfinished_requests() or self.hooks.has_ready_work()
                              or (self.overlap is not None and self.overlap.busy())):
                    timeout = 0
                else:
                    timeout = self.busy_poll_ms
                msgs = self.recv_requests(timeout)
                if msgs is None:  # the communicator says stop
                    break
                self.process_input_requests(msgs)
                if self.has_work():
                    ran = self.step()
                else:
                    ran = False
                    self.stream_output()
                if not ran and self.lender is not None:
                    self.lender.set_idle(True)
                if self.kv_events is not None:
                    self.kv_events.flush()
        finally:
            if self.overlap is not None:
                self.overlap.close()
            self.hooks.close()
            self.grammar_queue.close()
            if self.kv_events is not None:
                self.kv_events.close()
            if self.tracer is not None:
                self.tracer.close()

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
        """Requests per stage queue (the role's stages when it has its own)."""
        return self.hooks.queue_counts() or {"waiting": len(self.waiting_queue), "running": len(self.running_batch.reqs),
                                             "chunked": 1 if self.chunked_req is not None else 0}

    def get_stats(self) -> dict[str, Any]:
        return scheduler_stats(self)
