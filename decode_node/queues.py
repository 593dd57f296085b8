"""The decode role's queues: prealloc, transfer, waiting; then the scheduler's running batch.

The prealloc and waiting queues serve the highest priority first (SGLang's `priority`; arrival order
among equals).

* `PreallocQueue`: the request's `KVReceiver` asks the prefill node's bootstrap server for the
  layout and the overlapping prefill ranks (page size, model and layout are checked there); once
  resolved (`resolved`) and when memory allows, the role preallocates and moves it on;
* `TransferQueue`: its row, pages and metadata slot are reserved and the `TransferInfo` is sent;
  `arrived` names the requests whose KV is in (the receiver polled Success);
* `WaitingQueue`: received, waiting for a running slot (`admit`); then it joins the running
  batch as a prebuilt request (its KV is already in the pool: no prefill compute).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from common.scheduler.req import Req
from disaggregation.requests import PDRequest, StageQueue
from transfer.base import KVPoll

Rank = Callable[[Req], int]  # smaller first: common/scheduler/priority.py


class DecodeStage(enum.Enum):
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    WAITING = "waiting"


@dataclass(kw_only=True)
class DecodeRequest(PDRequest):
    """`conn` is the request's KVReceiver; `row`/`pages`/`metadata_index` are what the state still owns
    (the request takes the row and pages over when the KV has arrived)."""

    stage: DecodeStage = DecodeStage.PREALLOC
    row: int | None = None
    pages: list[int] | None = None
    num_pages: int = 0
    sent_at: float | None = None


class PreallocQueue(StageQueue):
    stage = DecodeStage.PREALLOC

    def resolved(self, polls: dict[str, KVPoll], rank: Rank | None = None) -> list[DecodeRequest]:
        """The requests whose receiver knows its prefill ranks, oldest first, or by `rank(req)` then
        oldest first (still in the queue)."""
        ready = [t for t in self if polls.get(t.rid, KVPoll.Failed) >= KVPoll.WaitingForInput]
        return ready if rank is None else sorted(ready, key=lambda t: rank(t.req))


class TransferQueue(StageQueue):
    stage = DecodeStage.TRANSFER

    def arrived(self, polls: dict[str, KVPoll]) -> list[DecodeRequest]:
        """The requests whose KV arrived (Success on every rank), oldest first (still in the queue)."""
        return [t for t in self if polls.get(t.rid) == KVPoll.Success]


class WaitingQueue(StageQueue):
    stage = DecodeStage.WAITING

    def admit(self, can_admit: Callable[[], bool], rank: Rank | None = None) -> Iterator[DecodeRequest]:
        """Oldest first (by `rank(req)` first when given), out of the queue while `can_admit()` (asked
        again once the caller has admitted the previous one)."""
        for t in self if rank is None else sorted(self, key=lambda t: rank(t.req)):
            if not can_admit():
                return
            self.discard(t)
            yield t
