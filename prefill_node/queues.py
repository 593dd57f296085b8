"""The prefill role's queues: bootstrap, then the scheduler's waiting queue, then inflight.

* `BootstrapQueue`: the request's `KVSender` (room = `bootstrap_room`) exists; it gets a metadata
  slot (FCFS, when one is free) and `init()`-s the sender, then waits until every overlapping decode
  rank sent its `TransferInfo` (the sender polls `WaitingForInput`); `take_ready` hands those on;
* waiting (in the scheduler: waiting queue, chunked prefill): normal prefill with
  `max_new_tokens` = 1; the role sends each chunk's full pages and, with the last chunk, the rest;
* `InflightQueue`: the last chunk is sent; the request keeps its KV and its answer until the
  transfer polls Success (`take_done`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from disaggregation.requests import PDRequest, StageQueue
from transfer.base import KVPoll


class PrefillStage(enum.Enum):
    BOOTSTRAP = "bootstrap"
    WAITING = "waiting"  # in the scheduler: waiting, being chunked, prefilling
    INFLIGHT = "inflight"


@dataclass(kw_only=True)
class PrefillRequest(PDRequest):
    """`conn` is the request's KVSender; pages `first_page .. first_page + num_pages - 1` are sent."""

    stage: PrefillStage = PrefillStage.BOOTSTRAP
    num_pages: int
    first_page: int = 0  # sliding window ("swa"): pages before the window are not sent
    sent_pages: int = 0  # pages sent so far (from page 0, the skipped ones counted)
    first_send: float | None = None


class BootstrapQueue(StageQueue):
    stage = PrefillStage.BOOTSTRAP

    def __init__(self, metadata_alloc) -> None:
        super().__init__()
        self.metadata_alloc = metadata_alloc

    def init_senders(self, rank=None) -> None:
        """Give requests without one a metadata slot and init() their sender, by `rank(req)` when given
        (common/scheduler/priority.py), oldest first among equals."""
        for t in self if rank is None else sorted(self, key=lambda t: rank(t.req)):
            if t.metadata_index is not None:
                continue
            slot = self.metadata_alloc.alloc()
            if slot is None:
                return
            t.metadata_index = slot
            t.conn.init(t.num_pages, slot)

    def take_ready(self, polls: dict[str, KVPoll]) -> list[PrefillRequest]:
        """The requests whose decode side sent its TransferInfo, oldest first, out of the queue."""
        ready = [t for t in self if polls.get(t.rid, KVPoll.Failed) >= KVPoll.WaitingForInput
                 and t.metadata_index is not None]
        for t in ready:
            self.discard(t)
            t.stage = PrefillStage.WAITING
            # traced on both sides: its transfer span links to the decode's request
            if t.req.traceparent and t.conn.peer_traceparent:
                t.req.trace_links["inflight"] = t.conn.peer_traceparent
        return ready


class InflightQueue(StageQueue):
    stage = PrefillStage.INFLIGHT

    def take_done(self, polls: dict[str, KVPoll]) -> list[PrefillRequest]:
        """The requests whose transfer polled Success, out of the queue."""
        done = [t for t in self if polls.get(t.rid) == KVPoll.Success]
        for t in done:
            self.discard(t)
        return done
