"""Scheduler: the requests of one TP rank (of one DP group), with the contract of vLLM's scheduler.

Contract
* `add_request(req)`: a new request joins the waiting queue; `add_prebuilt_reqs(reqs)`: requests whose
  prompt KV is already in the pool (a decode node's received KV) join the running batch;
* `schedule() -> SchedulerOutput`: a prefill batch if any waiting request can be admitted (the
  request being chunked goes first; with `decode_between_chunks`, a decode node's, the running batch
  decodes one step between two chunks), else one decode step of the running batch (retracting requests
  when KV memory runs out), else no batch;
* `update_from_output(out, runner_output) -> BatchOut | None`: append the sampled tokens and logprobs,
  check stops, release finished requests' memory (into the radix cache); returns the iteration's
  per-request updates (`output.py`), every end reported exactly once;
* `finish_requests(ids, status)`: end requests wherever they are and free their memory (unknown or
  already ended ids are skipped); `release_held(rid)`: end a request whose memory a role held;
* `get_request_counts() -> (running, waiting)`, `has_unfinished_requests()`.

`step()` is three phases: `out = schedule()`, `result = runner.run(out.batch)` (`common/runner.py`),
`update(out, result)` (`update_from_output`, then the BatchOut goes out). With overlap scheduling
(`--enable-overlap-schedule`, TP 1) the middle phase is `OverlapRunner.run`: a decode step's forward
runs on a worker thread, and the runner calls `update` back for each forward it has finished.
`event_loop` receives the front end's messages around the step; without a communicator (`comm=None`)
the scheduler is driven in process: `process_input_requests([...])`, `step()`, and `send_fn`
receives what it sends.

Who owns what (each component is given its collaborators here, in `__init__`):
* `queues` (`queues.py`): every request by stage: live, grammar, waiting, chunked, running, held;
* `intake` (`intake.py`: admission, validation) and the grammar queue (`grammar_queue.py`): the way in;
* `prefill` (`prefill.py`): the prefill batch: chunking, priority preemption, host-store restore,
  deferral of a prompt the batch already prefills, the mixed chunk;
* `decode` (`decode.py`): the running batch's decode (or verify) step, retracting when KV is short;
* `retraction` (`retraction.py`): retraction and the host store that keeps retracted requests' KV;
* `priority` (`priority.py`), `policy` and `new_token_ratio` (`policy.py`): order and budgets;
* `results` (`results.py`): the update phase and how a request ends (held, released, reported);
* `output` (`output.py`), `counters` and `stats` (`stats.py`), `overlap`, `drafter` (`speculative.py`);
* `switch` (`role_switch.py`): a role switch the group drains for; the loop ends when it may switch.
The scheduler keeps the wiring, the contract, the input dispatch and the loop.

A node role plugs in through `hooks` (`hooks.py`), set after construction (the setter hands them to
`intake` and `results`). A hook's exception never ends the loop: a per-request hook's failure ends
that request with error_status 500 (one log record with the rid and the traceback); `before_schedule`
and `stats` failures are logged and the loop goes on; `on_release` failures are logged and the
release completes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from common import core_loan
from common.config import ServerArgs
from common.forward_batch import ForwardMode
from common.grammar import GrammarCompiler
from common.layers.dp_attention import make_lockstep
from common.memory.radix_cache import make_tree_cache
from common.protocol import (
    AbortRequest,
    BatchOut,
    FlushCacheRequest,
    StatsQuery,
    StatsReport,
    SwitchRole,
    TokenizedRequest,
    Wake,
)
from common.runner import RunnerOutput
from common.scheduler import role_switch
from common.scheduler.batch import ScheduleBatch
from common.scheduler.decode import DecodeBuilder
from common.scheduler.grammar_queue import GrammarQueue
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.intake import Intake, fast_tokenizer, load_stop_decoder
from common.scheduler.output import OutputBatcher
from common.scheduler.overlap import OverlapRunner, overlap_choice
from common.scheduler.policy import NewTokenRatio, SchedulePolicy
from common.scheduler.prefill import PrefillBuilder
from common.scheduler.priority import PriorityScheduling
from common.scheduler.queues import RequestQueues
from common.scheduler.req import FinishStatus, Req
from common.scheduler.results import ResultProcessor
from common.scheduler.retraction import Retraction, make_host_store
from common.scheduler.speculative import make_drafter
from common.scheduler.stats import Counters, SchedulerStats, log_progress
from common.scheduler.trace import make_kv_events, make_tracer

logger = logging.getLogger("scheduler")

PROGRESS_LOG_EVERY = 200  # forwards between two progress lines in the log


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
        self.args, self.model_dir = args, model_dir
        self.dp_rank = dp_rank  # the DP group this scheduler is (--dp-size)
        self.pp_rank = pp_rank  # its pipeline stage (--pp-size): every stage schedules alike
        self.tp_rank, self.tp_size = tp_rank, tp_size
        first = tp_rank == 0 and pp_rank == 0  # the rank that speaks for the group
        if runner is None:
            from common.runner import ModelRunner

            runner = ModelRunner(args, model_dir, tp_rank, tp_size, tp_group,
                                 pp_rank=pp_rank, dp_rank=dp_rank)
        self.runner = runner
        self.model_config = runner.model_config
        self.vocab_size = self.model_config.vocab_size
        self.context_length = runner.context_length
        self.page_size = runner.page_size
        self.req_to_token_pool, self.allocator = runner.req_to_token_pool, runner.allocator
        self.kv_pool = runner.kv_pool
        self.max_running_requests = args.max_running_requests
        # models with recurrent state (hybrid) cannot reuse a cached prefix: see common/hybrid.py
        self.tree_cache = make_tree_cache(args.radix_cache_enabled
                                          and getattr(runner, "supports_radix_cache", True),
                                          self.req_to_token_pool, self.allocator, self.page_size)
        self.tracer = make_tracer(args) if first else None  # stage spans of released requests
        self.kv_events = make_kv_events(args, self.tree_cache, self.page_size, dp_rank, runner) \
            if first else None
        self.tokenizer = tokenizer if tokenizer is not None \
            else load_stop_decoder(args.tokenizer or model_dir)
        self.send_fn, self.comm = send_fn, comm
        self.stopping = False
        self.switch: role_switch.PendingSwitch | None = None  # draining for a role switch (SwitchRole)
        self.idle_poll_ms, self.busy_poll_ms = 500, 2
        self.lockstep = make_lockstep()  # DP attention: the DP groups agree on every step
        self.stop_agreed = False  # ... and stop after the step at whose agreement one of them stopped
        if self.lockstep is not None:
            # a busy group waits for the idle ones at each agreement: the front end wakes them with each
            # request (Wake), and this bounds the wait for whatever else starts work in one group only
            self.idle_poll_ms = 100
        # a decode node sets this: the running batch decodes one step after each chunk of a prompt
        self.decode_between_chunks = False
        self._chunk_scheduled = False  # the last batch scheduled was a chunk of an unfinished prompt
        # the prefill node lends its cores to its decode node while it has nothing to run
        # (common/core_loan.py)
        self.lender, self.borrower = core_loan.for_node(args, tp_rank)
        overlap, why = overlap_choice(args, tp_size)  # decode forwards on a worker thread (None: in sequence)
        self.overlap = OverlapRunner(runner, args.max_running_requests + 8, self.update) if overlap else None
        if tp_rank == 0:
            logger.info("overlap scheduling %s", why)
        self.drafter = make_drafter(args)  # --speculative-algorithm: decode steps verify drafts

        self.counters = Counters()
        tok_path = args.tokenizer or model_dir
        grammars = GrammarQueue(lambda: GrammarCompiler(tok_path, self.vocab_size, self.eos_token_ids,
                                                        fast_tokenizer(self.tokenizer)),
                                tp_size * getattr(args, "pp_size", 1))
        running = ScheduleBatch([], self.req_to_token_pool, self.allocator, self.kv_pool, self.tree_cache)
        self.queues = RequestQueues(running, grammars, self.overlap.num_deferred if self.overlap else None)
        store = make_host_store(args, self.page_size, self.kv_pool, self.req_to_token_pool)
        self.retraction = Retraction(store, running)
        self.priority = PriorityScheduling(args)  # --schedule-policy priority: order, preemption, full queue
        self.policy = SchedulePolicy(args.schedule_policy, self.tree_cache, self.priority)
        self.new_token_ratio = NewTokenRatio(args.init_new_token_ratio, args.min_new_token_ratio,
                                             args.new_token_ratio_decay_steps)
        self.output = OutputBatcher(args.stream_interval)
        self.decode = DecodeBuilder(self.queues, self.retraction, self.priority, self.new_token_ratio,
                                    self.context_length, drafter=self.drafter, overlap=self.overlap)
        self.results = ResultProcessor(self.queues, runner, self.counters, self.output, self.retraction,
                                       drafter=self.drafter, overlap=self.overlap, tracer=self.tracer)
        self.prefill = PrefillBuilder(args, self.queues, self.policy, self.priority, self.retraction,
                                      self.new_token_ratio, self.counters, self.results)
        self.intake = Intake(args, runner, self.tokenizer, self.queues, self.priority,
                             self.results, self.counters)
        self.stats = SchedulerStats(args, dp_rank, runner, self.queues, self.counters,
                                    tree_cache=self.tree_cache,
                                    admission=self.intake.admission, retraction=self.retraction,
                                    new_token_ratio=self.new_token_ratio, priority=self.priority,
                                    overlap=self.overlap, drafter=self.drafter, kv_events=self.kv_events)
        self.hooks = SchedulerHooks()

    @classmethod
    def make_req_pool(cls, args):
        """The role's request table, as `ModelRunner(make_req_pool=...)` takes it (None: the runner's own)."""
        return None

    @property
    def hooks(self) -> SchedulerHooks:
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: SchedulerHooks) -> None:
        self._hooks = self.results.hooks = self.intake.hooks = hooks

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's EOS tokens: they end requests here and are masked by min_new_tokens in the runner."""
        return self.runner.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.runner.eos_token_ids = list(ids)

    # the components' state under the names the roles, tests and benches read
    live_reqs = property(lambda self: self.queues.live_reqs)
    waiting_queue = property(lambda self: self.queues.waiting_queue)
    chunked_req = property(lambda self: self.queues.chunked_req)
    running_batch = property(lambda self: self.queues.running_batch)
    held = property(lambda self: self.queues.held)
    host_store = property(lambda self: self.retraction.host_store)
    num_retractions = property(lambda self: self.retraction.num_retractions)
    num_mixed_steps = property(lambda self: self.counters.num_mixed_steps)

    # ================================================================== the step: schedule -> run -> update
    def step(self) -> bool:
        """One engine step (after the input); returns whether a forward ran (or was launched)."""
        out = self.schedule()
        if self.lockstep is not None:  # DP attention: every group forwards when any does
            busy, stop = self.lockstep.agree(out.batch is not None, self.has_work(), self.stopping)
            self.stopping = self.stopping or stop
            self.stop_agreed = stop
            if out.batch is None and busy:
                self.runner.idle_forward()
        if out.batch is None:
            if self.overlap is not None:
                self.overlap.drain()  # the forwards in flight are processed first
            self.update(out, None)
            return False
        self.before_forward()
        if self.overlap is not None:
            self.overlap.run(out, self.running_batch)  # calls `update` for each forward as it is done
            return True
        result = self.runner.run(out.batch)
        if self.borrower is not None:
            self.borrower.after_forward()
        self.update(out, result)
        return True

    def schedule(self) -> SchedulerOutput:
        """The role moves its queues on first; then a prefill batch, else a decode step, else nothing (with
        `decode_between_chunks`, a decode step comes between two chunks of a prompt)."""
        try:
            self.hooks.before_schedule()
        except Exception:
            logger.exception("before_schedule hook failed; the loop goes on")
        self.queues.grammar_queue.poll(self.intake.start, self.intake.grammar_failed)
        if self.overlap is not None:
            self.overlap.before_building(self.queues)
        out = SchedulerOutput()
        decode_turn = self.decode_between_chunks and self._chunk_scheduled and bool(self.running_batch.reqs)
        out.batch = None if decode_turn else self.prefill.build()
        mixed = out.batch is not None and self.prefill.mix_running(out.batch)
        self._chunk_scheduled = out.batch is not None and self.chunked_req is not None and not mixed
        if out.batch is None and self.running_batch.reqs:
            out.batch, out.retracted = self.decode.build()
        return out

    def update(self, out: SchedulerOutput, result: RunnerOutput | None) -> None:
        """The step's last phase: apply the result and send the iteration's updates."""
        self.emit(self.update_from_output(out, result))

    def before_forward(self) -> None:
        """A forward is about to run (or launch): what the schedule recorded goes out first (see
        `stream_output`), the prefill node stops lending its cores, the decode node borrows them if lent."""
        self.stream_output()
        if self.lender is not None:
            self.lender.set_idle(False)
        if self.borrower is not None:
            self.borrower.before_forward()

    # ================================================================== contract
    def add_request(self, req: Req) -> None:
        """A new request (or one a role held since it arrived) joins the waiting queue."""
        self.queues.add_waiting(req)

    def add_prebuilt_reqs(self, reqs: list[Req]) -> None:
        """Requests whose prompt KV is already in the pool join the running batch without prefill:
        each has `req_pool_idx`, `kv_len` = prompt length and `output_ids` = [first token]."""
        self.intake.add_prebuilt(reqs)

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput | None) -> BatchOut | None:
        """Apply what the runner produced for `out.batch`; returns every update of this iteration
        (the input's refusals and aborts included), one per request, or None."""
        batch = out.batch
        if batch is not None:
            self.results.apply(batch, result)
            decoded = batch.mode != ForwardMode.EXTEND or batch.extend_info.decode_rows > 0
            if decoded and self.counters.forward_ct % PROGRESS_LOG_EVERY == 0:
                log_progress(self.get_stats())
        return self.output.take()

    def finish_requests(self, request_ids: str | Iterable[str], status: FinishStatus) -> None:
        """End requests now, wherever they are, free their memory and report their end. Unknown ids
        and requests that already ended are skipped, so finishing twice is harmless."""
        self.results.end([request_ids] if isinstance(request_ids, str) else list(request_ids), status)

    def release_held(self, rid: str) -> None:
        """The role is done with a request it held after it finished: free its memory, report its end."""
        self.results.release_held(rid)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting): the running batch and the request being chunked; the waiting queue."""
        return self.queues.num_running_slots_used(), len(self.waiting_queue)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, being chunked or running (not those only a role holds)."""
        return self.queues.has_unfinished()

    # ================================================================== input
    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, TokenizedRequest):
                self.intake.accept(msg)
            elif isinstance(msg, AbortRequest):
                self.abort_request(msg.rid, msg.message)
            elif isinstance(msg, StatsQuery):
                self._send_admitted()
                self.send(StatsReport(qid=msg.qid, stats=self.get_stats()))
            elif isinstance(msg, Wake):
                pass  # it only ended the wait for input: the step agreement comes next
            elif isinstance(msg, SwitchRole):
                self.switch = role_switch.begin(self, msg) or self.switch  # a refusal keeps the one on
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
        admitted = self.intake.admission.take_admitted()
        if admitted:
            self.send(BatchOut(updates=[], admitted=admitted))

    def make_req(self, msg: TokenizedRequest) -> Req:
        return self.intake.make_req(msg)

    def abort_request(self, rid: str, message: str = "aborted by client") -> None:
        """The front end's abort: one request, or every live one for rid ""."""
        self.finish_requests(list(self.live_reqs) if rid == "" else [rid], FinishStatus.abort(message))

    def num_queued_reqs(self) -> int:
        """Requests here that are not running yet (--max-queued-requests counts them)."""
        return self.queues.num_queued()

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

    def has_work(self) -> bool:
        return (self.has_unfinished_requests() or self.hooks.has_work() or bool(self.queues.grammar_queue)
                or (self.overlap is not None and self.overlap.busy()))

    def event_loop(self, beat=None) -> None:
        """Serve until told to stop; `beat()` (the watchdog's) runs once per iteration."""
        ran = False
        try:
            while not (self.stop_agreed if self.lockstep is not None else self.stopping):
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
                if self.lockstep is not None and self.lockstep.others_busy:
                    timeout = 0  # the other groups wait at the next agreement
                elif self.lockstep is not None and self.lockstep.others_waiting:
                    timeout = min(timeout, self.busy_poll_ms)
                msgs = self.comm.recv(timeout) if self.comm is not None else []
                if msgs is None:  # the communicator says stop
                    if self.lockstep is None:
                        self.stopping = True
                        break
                    self.stopping = True  # the other groups learn it at the agreement, then all stop
                self.process_input_requests(msgs or [])
                if self.has_work() or self.lockstep is not None:  # DP attention: an agreement every turn
                    ran = self.step()
                else:
                    ran = False
                    self.stream_output()
                if not ran and self.lender is not None:
                    self.lender.set_idle(True)
                if self.kv_events is not None:
                    self.kv_events.flush()
                if self.switch is not None and role_switch.ready(self):
                    break  # drained: the scheduler process builds the new role's scheduler
        finally:
            self.close()

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        self.hooks.close()
        self.queues.grammar_queue.close()
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

    def get_stats(self) -> dict[str, Any]:
        """/server_info's figures (`stats.py`), the role's and the core loan's read now: a role installs
        its hooks after construction, and a test may swap the lender."""
        return self.stats.collect(self.hooks, self.lender, self.borrower)
