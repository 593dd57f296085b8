"""DecodeBuilder: the running batch's next step, when no prefill batch is scheduled (`build`).

* KV memory for the next tokens short: `Retraction.retract_for_decode` takes requests out (the lowest
  priority first under priority scheduling, else the fewest output tokens) and they go to the front of
  the waiting queue; `new_token_ratio` jumps to the new estimate. Otherwise the ratio decays.
* with overlap scheduling the batch leaves out the requests the step in flight brings to their end
  (`OverlapRunner.decode_batch_ahead`) and feeds placeholders for the tokens not sampled yet;
* with a drafter, a verify step when any request drafts and the pages for the drafts are free (drafts
  never evict or retract), else a plain decode step.
"""

from __future__ import annotations

from common.scheduler.batch import ScheduleBatch
from common.scheduler.policy import NewTokenRatio
from common.scheduler.priority import PriorityScheduling
from common.scheduler.queues import RequestQueues
from common.scheduler.retraction import Retraction


class DecodeBuilder:
    def __init__(self, queues: RequestQueues, retraction: Retraction, priority: PriorityScheduling,
                 new_token_ratio: NewTokenRatio, context_length: int, *, drafter=None, overlap=None) -> None:
        self.queues = queues
        self.retraction = retraction
        self.priority = priority
        self.new_token_ratio = new_token_ratio
        self.context_length = context_length
        self.drafter = drafter
        self.overlap = overlap

    def build(self) -> tuple[ScheduleBatch | None, list[str]]:
        """(the batch, None when retraction left nothing to run; the rids retracted)."""
        batch = self.queues.running_batch
        retracted: list[str] = []
        if batch.check_decode_mem():
            self.new_token_ratio.decay()
        else:
            order = self.priority.retract_key if self.priority.enabled else None
            victims, ratio = self.retraction.retract_for_decode(order)
            retracted = [v.rid for v in victims]
            self.queues.waiting_queue[:0] = victims
            self.new_token_ratio.on_retract(ratio)
            if not batch.reqs:
                return None, retracted
        if self.overlap is not None:
            batch = self.overlap.decode_batch_ahead(batch)
            if batch is not None:
                batch.prepare_for_decode(self.overlap.pending_token)
            return batch, retracted
        if self.drafter is not None:
            drafts = self.drafter.drafts_for(batch.reqs, self.context_length)
            if any(drafts) and batch.verify_pages_needed(drafts) <= batch.allocator.available_pages():
                batch.prepare_for_verify(drafts)
                return batch, retracted
        batch.prepare_for_decode()
        return batch, retracted
