"""PrefillBuilder: the next prefill batch, if any waiting request can be admitted (`build`).

One round, in order, each step owned by the component it concerns:

1. the request being chunked goes first (`PrefillAdder.add_chunked_req`: its next chunk);
2. the waiting queue in the policy's order (`SchedulePolicy.calc_priority`), while the adder's budgets
   allow (`prefill_adder.py`). Per request:
   * no running slot or req pool row left: priority preemption may free one
     (`PriorityScheduling.preempt`, which retracts through `Retraction.preempt`);
   * a retracted request whose KV waits in the host store is restored, not prefilled
     (`PrefillAdder.add_restored_req`, then `Retraction.restore`);
   * a request whose prompt this batch already prefills (the copies of `n` > 1) is deferred one round,
     so it takes that KV from the radix cache (`_deferred`);
   * its prompt + output's KV short: priority preemption again, then `PrefillAdder.add_one_req`;
3. the requests picked leave the waiting queue: restored ones join the running batch, the others form
   the extend batch (one of them may become the new chunked request);
4. nothing fits although every page and row is free: the head request never will, and is refused.

With `--enable-mixed-chunk` the running requests decode in that prefill forward too (`mix_running`).
"""

from __future__ import annotations

import logging
import time

from common.scheduler.batch import ScheduleBatch
from common.scheduler.policy import NewTokenRatio, SchedulePolicy
from common.scheduler.prefill_adder import AddResult, PrefillAdder
from common.scheduler.priority import PriorityScheduling
from common.scheduler.queues import RequestQueues
from common.scheduler.req import FinishStatus, Req, Stage
from common.scheduler.results import ResultProcessor
from common.scheduler.retraction import Retraction
from common.scheduler.stats import Counters

logger = logging.getLogger("scheduler")


class PrefillBuilder:
    def __init__(self, args, queues: RequestQueues, policy: SchedulePolicy, priority: PriorityScheduling,
                 retraction: Retraction, new_token_ratio: NewTokenRatio, counters: Counters,
                 results: ResultProcessor) -> None:
        self.args = args
        self.queues = queues
        self.policy = policy
        self.priority = priority
        self.retraction = retraction
        self.new_token_ratio = new_token_ratio
        self.counters = counters
        self.results = results  # ends a request that never fits
        running = queues.running_batch
        self.tree_cache = running.tree_cache
        self.allocator = running.allocator
        self.req_to_token_pool = running.req_to_token_pool
        self.kv_pool = running.kv_pool

    def build(self) -> ScheduleBatch | None:
        queues = self.queues
        chunked = queues.chunked_req
        if chunked is None and not queues.waiting_queue:
            return None
        slots_left = self.args.max_running_requests - queues.num_running_slots_used()
        if chunked is None and slots_left <= 0 and not self.priority.preemption:
            return None
        self.policy.calc_priority(queues.waiting_queue)
        adder = PrefillAdder(self.tree_cache, self.allocator, queues.running_batch.reqs,
                             self.new_token_ratio.value, self.args.max_prefill_tokens,
                             self.args.chunked_prefill_size)
        if chunked is not None:
            chunked.init_next_round_input(self.tree_cache)
            adder.add_chunked_req(chunked)
        if chunked is None or chunked in adder.can_run_list:
            self._add_waiting(adder, slots_left, chunked)
        restored = self._restore(adder.restore_list)
        if not adder.can_run_list:
            if not restored:
                self._refuse_if_never_fits()
            return None
        return self._extend_batch(adder, chunked)

    def _add_waiting(self, adder: PrefillAdder, slots_left: int, chunked: Req | None) -> None:
        """Step 2: add waiting requests while the budgets allow; preemption victims join the waiting
        queue after the round (the policy orders them by priority next round)."""
        running = self.queues.running_batch
        rows_free = self.req_to_token_pool.available_size()
        preempted: list[Req] = []
        prompts: set[int] = set()  # hashes of the prompts this batch prefills
        for req in self.queues.waiting_queue:
            new = len(adder.can_run_list) + len(adder.restore_list) - (1 if chunked is not None else 0)
            if new >= slots_left or new >= rows_free:
                victims = self.priority.preempt(adder, req, True, running, self.retraction)
                if not victims:
                    break
                preempted += victims
                slots_left, rows_free = slots_left + len(victims), rows_free + len(victims)
            if self.retraction.holds(req.rid):
                added = adder.add_restored_req(req, self.retraction.kv_len(req.rid))
            else:
                req.init_next_round_input(self.tree_cache)
                if self._deferred(req, prompts):
                    continue
                preempted += self.priority.preempt(adder, req, False, running, self.retraction)
                added = adder.add_one_req(req)
            if added is not AddResult.CONTINUE:
                break
        self.queues.waiting_queue += preempted

    def _deferred(self, req: Req, prompts: set[int]) -> bool:
        """Whether `req`'s prompt is one this batch already prefills (the copies of a request with n > 1,
        or clients sending the same prompt together): with the prefix cache on, it waits one round and
        then finds the prompt's KV cached. Records the prompt of a request that is not deferred."""
        if not self.tree_cache.enabled or req.is_retracted \
                or req.extend_input_len <= self.allocator.page_size:
            return False
        key = hash(tuple(req.origin_input_ids))
        if key in prompts:
            return True
        prompts.add(key)
        return False

    def _restore(self, restored: list[Req]) -> bool:
        """Step 3, host store: back into the running batch now; they decode with the next decode step."""
        if not restored:
            return False
        self.queues.take_from_waiting(restored)
        for r in restored:
            self.retraction.restore(r)
            r.mark("decode")
        return True

    def _extend_batch(self, adder: PrefillAdder, chunked: Req | None) -> ScheduleBatch:
        """Step 3, prefill: the picked requests leave the waiting queue and form the extend batch."""
        queues, can_run = self.queues, adder.can_run_list
        if chunked is None or chunked in can_run:
            queues.chunked_req = adder.new_chunked_req
        queues.take_from_waiting(can_run)
        for r in can_run:
            # leaves the waiting queue to prefill prompt + output again
            if r.is_retracted and r is not chunked:
                self.retraction.num_recomputed += 1
            if not r.scheduled_once:
                self.counters.queue_time.observe(max(0.0, time.time() - r.arrival_time))
            r.scheduled_once = True
            r.stage = Stage.CHUNKED if r is queues.chunked_req else Stage.RUNNING
            r.mark("prefill")
        batch = ScheduleBatch(can_run, self.req_to_token_pool, self.allocator, self.kv_pool, self.tree_cache)
        batch.prepare_for_extend()
        self.counters.total_prefill_tokens += sum(r.extend_input_len for r in can_run)
        return batch

    def _refuse_if_never_fits(self) -> None:
        """Step 4: with every page and row free, a request at the head that still cannot be admitted
        never will be (validation should prevent this): refuse it rather than spin."""
        queues = self.queues
        if queues.running_batch.reqs or queues.chunked_req is not None or not queues.waiting_queue:
            return
        if (self.allocator.available_size() + self.tree_cache.evictable_size() < self.allocator.capacity
                or self.req_to_token_pool.available_size() < self.req_to_token_pool.size):
            return
        req = queues.waiting_queue[0]
        logger.error("rid=%s cannot be scheduled even with an empty KV cache; refused", req.rid)
        self.results.end([req.rid], FinishStatus.abort("the request does not fit the KV cache", 503))

    def mix_running(self, batch: ScheduleBatch) -> bool:
        """--enable-mixed-chunk: the running requests decode their next token in this prefill forward, if
        the KV memory for it is free (else they decode, or retract, in a step of their own next)."""
        running = self.queues.running_batch
        if not (self.args.enable_mixed_chunk and running.reqs and running.check_decode_mem()):
            return False
        batch.mix_with_running(list(running.reqs))
        self.new_token_ratio.decay()
        self.counters.num_mixed_steps += 1
        return True
