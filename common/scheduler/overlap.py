"""Overlap scheduling: the forward of decode step n runs on a worker thread
while the scheduler loop receives requests, builds step n+1 and then processes step n's result.

Step n+1 is built before step n's tokens are known, so its input ids for requests of step n are
placeholders: `-slot` of a `FutureMap` row. The worker runs forwards one at a time in launch order;
before a forward it replaces the placeholders with the tokens the previous forward stored there,
and after sampling it stores this forward's tokens in the rows the batch reserved.

What the loop must respect (`OverlapRunner.run`, `before_building`, `decode_batch_ahead`):
* only decode steps stay in flight across a loop iteration; a prefill batch is waited for at once;
* a request whose memory is released while a forward that writes it is in flight (it finished in
  the step before, or was aborted) keeps that memory until the forward is done (`in_flight`,
  `defer`, `completed`): pages and rows are never handed to anyone while a kernel may write them;
* a step whose sampling reads the tokens generated so far (penalties, grammars, min_new_tokens not
  reached) or that must retract, prefill or preempt waits for the step in flight first.

The scheduler's step is the same three phases with or without overlap: `schedule()`, then `run(out)`
here instead of the runner's forward, and the update phase, which this runner calls back
(`on_result(out, result)`) for each forward it has finished, oldest first.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from concurrent.futures import Future

import torch

from common.forward_batch import ForwardMode
from common.scheduler.batch import ScheduleBatch

logger = logging.getLogger("scheduler")


def overlap_choice(args, tp_size: int) -> tuple[bool, str]:
    """Whether this rank overlaps (`--enable-overlap-schedule`, at TP 1 only), and why (logged)."""
    if not args.enable_overlap_schedule:
        return False, "off (--enable-overlap-schedule turns it on)"
    if tp_size > 1:  # the loop's own collectives share the process group of the forward's all-reduces
        return False, "off (TP > 1: the loop's collectives and the forward's must not interleave)"
    return True, f"on ({torch.get_num_threads()} torch threads, {len(os.sched_getaffinity(0))} cores)"


class FutureMap:
    """Token ids not sampled yet: row `slot` holds the token a launched forward will sample there."""

    def __init__(self, size: int) -> None:
        self.tokens = torch.zeros(size + 1, dtype=torch.int64)  # row 0 unused: -0 is not a placeholder
        self.size = size
        self._next = 0

    def reserve(self, n: int) -> list[int]:
        """`n` rows, cyclically (a row is read by the very next forward, long before it comes round)."""
        rows = [(self._next + i) % self.size + 1 for i in range(n)]
        self._next = (self._next + n) % self.size
        return rows

    def resolve(self, input_ids: torch.Tensor) -> None:
        """Replace the placeholders (-row) in `input_ids` by the tokens stored there, in place."""
        neg = input_ids < 0
        if bool(neg.any()):
            input_ids[neg] = self.tokens[-input_ids[neg]]

    def store(self, rows: list[int], token_ids: list[int | None]) -> None:
        self.tokens[torch.tensor(rows, dtype=torch.int64)] = torch.tensor(token_ids, dtype=torch.int64)


class Launched:
    """One batch handed to the worker: the scheduler's output, its sequence number, its result."""

    def __init__(self, out, seq: int) -> None:
        self.out = out
        self.seq = seq
        self.future: Future = Future()


class OverlapRunner:
    """Runs the scheduler's forwards on one daemon thread, in launch order."""

    def __init__(self, runner, batch_rows: int, on_result) -> None:
        self.runner = runner
        self.on_result = on_result  # the scheduler's update phase: on_result(scheduler output, RunnerOutput)
        self.futures = FutureMap(4 * batch_rows)
        self.in_flight_batches: collections.deque[Launched] = collections.deque()
        self.launched = 0  # sequence number of the last launched batch
        self.completed = 0  # ... of the last whose result the scheduler took
        self.overlapped = 0  # batches launched while the one before was still in flight
        self._deferred: list[tuple] = []  # (seq, req, release): memory that waits for that forward
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first launch

    # ------------------------------------------------------------------ launch and results
    def launch(self, out) -> Launched:
        """Hand `out.batch` (prepared) to the worker; its requests' next tokens become placeholders."""
        self.launched += 1
        self.overlapped += bool(self.in_flight_batches)
        job = Launched(out, self.launched)
        reqs = out.batch.reqs
        rows = self.futures.reserve(len(reqs)) if out.batch.extend_info is None else None
        for i, r in enumerate(reqs):
            r.inflight_seq = self.launched
            r.future_row = rows[i] if rows is not None else None
        self.in_flight_batches.append(job)
        if self._thread is None:
            self._threads = torch.get_num_threads()
            self._thread = threading.Thread(target=self._work, name="forward", daemon=True)
            self._thread.start()
        self._jobs.put((job, rows))
        return job

    def pending_token(self, req) -> int | None:
        """The placeholder of `req`'s last token if a forward in flight samples it, else None."""
        if req.future_row is not None and req.inflight_seq > self.completed:
            return -req.future_row
        return None

    def take_oldest(self):
        """Wait for the oldest batch in flight; returns (its scheduler output, its RunnerOutput)."""
        job = self.in_flight_batches.popleft()
        result = job.future.result()  # re-raises the forward's exception here, in the loop
        self.completed = job.seq
        return job.out, result

    def busy(self) -> bool:
        return bool(self.in_flight_batches or self._deferred)

    # ------------------------------------------------------------------ the loop's side
    def run(self, out, running: ScheduleBatch) -> None:
        """Launch `out.batch`'s forward on the worker, then process the results that are due: a decode
        step stays in flight while the loop goes on; a prefill batch is waited for at once."""
        if out.batch is running:  # its list of requests changes while the forward runs
            out.batch = out.batch.snapshot()
        self.launch(out)
        self.drain(keep=0 if out.batch.mode == ForwardMode.EXTEND else 1)

    def drain(self, keep: int = 0) -> None:
        """Process the results of the forwards in flight, oldest first, until `keep` are left."""
        while len(self.in_flight_batches) > keep:
            out, result = self.take_oldest()
            self.on_result(out, result)
            self.release_completed()

    def before_building(self, queues) -> None:
        """Called by `schedule()` before it builds a batch from `queues` (common/scheduler/queues.py):
        the step in flight is processed first unless the next is another decode step of the same
        requests, with memory for it, whose sampling does not read the tokens generated so far (the
        last one is not known yet)."""
        if not self.in_flight_batches:
            return
        running = queues.running_batch
        ahead = (not queues.waiting_queue and queues.chunked_req is None and running.reqs
                 and self.in_flight_batches[-1].out.batch.mode == ForwardMode.DECODE
                 and running.check_decode_mem() and all(map(needs_no_history, running.reqs)))
        if not ahead:
            self.drain()

    def decode_batch_ahead(self, running: ScheduleBatch) -> ScheduleBatch | None:
        """The decode batch to build from the running batch: without the requests the step in flight
        brings to max_new_tokens (None: nothing is left to run)."""
        going_on = [r for r in running.reqs if self.pending_token(r) is None
                    or len(r.output_ids) + 1 < r.max_new_tokens]
        if len(going_on) == len(running.reqs):
            return running
        if not going_on:
            return None
        return ScheduleBatch(going_on, running.req_to_token_pool, running.allocator, running.kv_pool,
                             running.tree_cache)

    # ------------------------------------------------------------------ memory a forward may write
    def in_flight(self, req) -> bool:
        return getattr(req, "inflight_seq", 0) > self.completed

    def defer(self, req, release) -> None:
        """Release `req`'s memory (`release(req)`) once the last forward it is in is done."""
        self._deferred.append((req.inflight_seq, req, release))

    def num_deferred(self) -> int:
        return len(self._deferred)

    def release_completed(self) -> None:
        done = [d for d in self._deferred if d[0] <= self.completed]
        if done:
            self._deferred = [d for d in self._deferred if d[0] > self.completed]
            for _seq, req, release in done:
                release(req)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    # ------------------------------------------------------------------ the worker thread
    def _work(self) -> None:
        torch.set_num_threads(self._threads)  # OpenMP's thread count is per thread: the loop's setting
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # the current GPU is per thread too
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, rows = item
            try:
                batch = job.out.batch
                self.futures.resolve(batch.forward_batch.input_ids)
                result = self.runner.run(batch)
                if rows is not None:
                    self.futures.store(rows, result.next_token_ids)
                job.future.set_result(result)
            except BaseException as e:  # noqa: BLE001  (handed to the loop, which decides)
                job.future.set_exception(e)


def needs_no_history(req) -> bool:
    """Its next token's sampling does not read its output so far (penalties, a grammar's state, a
    min_new_tokens still banning EOS do)."""
    p = req.sampling
    return (req.grammar is None and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and p.repetition_penalty == 1.0 and len(req.output_ids) >= p.min_new_tokens)
