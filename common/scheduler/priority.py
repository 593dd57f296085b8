"""Priority scheduling, SGLang's semantics.

* A request's `priority` is an int; by default a larger value runs first (SGLang's default),
  `--schedule-low-priority-values-first` reverses it (vLLM's order). Requests without one have priority 0.
  `rank(req)` folds the direction in: a smaller rank runs first.
* Under every policy the waiting queue (and a PD node's role queues) are ordered by rank, arrival order
  within a rank (`SchedulePolicy.calc_priority`): with no priority named that is exactly FCFS.
  `--schedule-policy priority` adds the rest:
* preemption (`--enable-priority-preemption`): when the request at hand cannot be admitted because the
  KV budget or the running slots are short, running requests it outranks by more than
  `--priority-scheduling-preemption-threshold` are retracted, lowest priority first (the latest arrival
  first among equals), until it fits; if even all of them would not make room, none is retracted.
  Victims go back to the waiting queue through the same retraction as an out-of-memory decode step
  (`Retraction.preempt`: their KV to the host store when `--decode-offload-size` allows), so they
  resume with the same tokens.
* an out-of-memory decode step retracts the lowest priority first (`retract_key`);
* a full queue (`--max-queued-requests`) turns away the lowest priority first: a newcomer that
  outranks the lowest-ranked request still waiting to start takes its place, and that one is answered
  429 (`queue_full_victim`).

This object holds the priority settings and counters; the queues and the retraction it acts on are
handed to each call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.scheduler.batch import ScheduleBatch
from common.scheduler.prefill_adder import CLIP_MAX_NEW_TOKENS
from common.scheduler.req import FinishStatus, Req, Stage

if TYPE_CHECKING:
    from collections.abc import Iterable

    from common.scheduler.prefill_adder import PrefillAdder
    from common.scheduler.retraction import Retraction

logger = logging.getLogger("scheduler")


class PriorityScheduling:
    def __init__(self, args) -> None:
        self.enabled = args.schedule_policy == "priority"
        self.low_first = bool(getattr(args, "schedule_low_priority_values_first", False))
        self.preemption = self.enabled and bool(getattr(args, "enable_priority_preemption", False))
        self.threshold = int(getattr(args, "priority_scheduling_preemption_threshold", 10))
        self.num_preemptions = 0  # running requests retracted for a higher-priority one
        self.num_queue_full_displaced = 0  # waiting requests answered 429 for a higher-priority newcomer

    def rank(self, req: Req) -> int:
        """Smaller runs first."""
        return req.priority if self.low_first else -req.priority

    def outranks(self, a: Req, b: Req, margin: int = 0) -> bool:
        """`a` has higher priority than `b` by more than `margin`."""
        return self.rank(b) - self.rank(a) > margin

    def retract_key(self, req: Req) -> tuple:
        """Victims of an out-of-memory decode step: the lowest priority first, then the usual order."""
        return (-self.rank(req), *ScheduleBatch.retract_order_key(req))

    def sort(self, queue: list[Req]) -> None:
        """By rank; the sort is stable, so arrival order (retracted requests first) holds within a rank."""
        queue.sort(key=self.rank)

    # ------------------------------------------------------------------ preemption
    def preempt(self, adder: PrefillAdder, req: Req, slot: bool, running: ScheduleBatch,
                retraction: Retraction) -> list[Req]:
        """Retract requests of `running` that `req` outranks by more than the threshold so that it can be
        admitted: for a running slot and req pool row (`slot`: at least one victim), and for its KV
        (prompt + clipped output) beyond what the adder has left. Returns the victims (out of the
        running batch, stage WAITING, not yet in the waiting queue: the caller puts them there), []
        when preemption cannot make room."""
        if not self.preemption:
            return []
        page = adder.page_size
        pre = min(len(req.prefix_indices), len(req.fill_ids))
        reserve = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        need = adder.allocator.pages_needed(pre, len(req.fill_ids) - pre + reserve) * page
        short = need - adder.rem_total_tokens  # KV tokens missing (a slot is missing too when `slot`)
        if short <= 0 and not slot:
            return []
        cands = [r for r in running.reqs if self.outranks(req, r, self.threshold)]
        cands.sort(key=lambda r: (-self.rank(r), -r.arrival_time))
        victims: list[Req] = []
        freed = 0
        for r in cands:
            if victims and freed >= short:
                break
            victims.append(r)
            freed += adder.allocator.pages_for(r.kv_len) * page + adder.reserve_running(r)
        if not victims or freed < short:
            return []
        for v in victims:
            adder.running_reserved -= adder.reserve_running(v)
            retraction.preempt(v)
            logger.info("rid=%s preempted by rid=%s (priority %d over %d) after %d output tokens; %s", v.rid,
                        req.rid, req.priority, v.priority, len(v.output_ids),
                        "KV in the host store" if retraction.holds(v.rid) else "will prefill again")
        self.num_preemptions += len(victims)
        return victims

    # ------------------------------------------------------------------ full queue
    def queue_full_victim(self, live_reqs: Iterable[Req], newcomer: Req) -> Req | None:
        """The request a full queue turns away for `newcomer`: the lowest-ranked one not started yet
        (waiting, or in a role's queue; retracted requests have started), the latest arrival among
        equals, if `newcomer` outranks it; else None (the newcomer is turned away)."""
        if not self.enabled:
            return None
        waiting = [r for r in live_reqs
                   if r.stage in (Stage.WAITING, Stage.NEW) and not r.scheduled_once and not r.is_retracted]
        if not waiting:
            return None
        lowest = max(waiting, key=lambda r: (self.rank(r), r.arrival_time))
        return lowest if self.outranks(newcomer, lowest) else None

    def turn_away(self, victim: Req, newcomer: Req) -> FinishStatus:
        """How `victim` ends (429, with Retry-After at the front end) so that `newcomer` takes its place."""
        self.num_queue_full_displaced += 1
        logger.info("rid=%s turned away from the full queue for rid=%s (priority %d over %d)", victim.rid,
                    newcomer.rid, newcomer.priority, victim.priority)
        return FinishStatus.abort(
            f"the node's queue is full and a request of higher priority ({newcomer.priority}) arrived; this "
            f"request (priority {victim.priority}) is turned away first (--max-queued-requests); "
            "retry later", 429)

    def stats(self) -> dict[str, int]:
        return {"num_priority_preemptions": self.num_preemptions,
                "num_queue_full_displaced": self.num_queue_full_displaced}
