"""RequestQueues: where each of the scheduler's requests is, one container per stage (`Req.stage`).

* `live_reqs`: every request from its arrival to its end, by rid;
* the grammar queue (`grammar_queue.py`): Stage.NEW requests whose grammar still compiles (a role's own
  queues hold the other Stage.NEW requests);
* `waiting_queue`: Stage.WAITING, new and retracted requests waiting for a prefill (or a restore);
* `chunked_req`: Stage.CHUNKED, the one request whose prompt is prefilled in chunks;
* `running_batch`: Stage.RUNNING, the requests that decode;
* `held`: finished requests whose memory a role holds (`SchedulerHooks.on_finished`).

The components that move requests between stages (the prefill builder, retraction, the result
processor) are given this object and change these containers directly; it answers the counts the
scheduler's contract, admission and the stats read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from common.scheduler.batch import ScheduleBatch
from common.scheduler.grammar_queue import GrammarQueue
from common.scheduler.req import Req, Stage


class RequestQueues:
    def __init__(self, running_batch: ScheduleBatch, grammar_queue: GrammarQueue,
                 deferred: Callable[[], int] | None = None) -> None:
        self.live_reqs: dict[str, Req] = {}
        self.grammar_queue = grammar_queue
        self.waiting_queue: list[Req] = []
        self.chunked_req: Req | None = None
        self.running_batch = running_batch
        self.held: dict[str, Req] = {}
        # ended requests whose memory waits for a forward in flight (overlap scheduling): they hold slots
        self._deferred = deferred

    def add_waiting(self, req: Req) -> None:
        """A new request (or one a role kept since it arrived) joins the waiting queue."""
        known = self.live_reqs.get(req.rid)
        if (known is not None and known is not req) or req.stage is not Stage.NEW:
            raise ValueError(f"rid={req.rid} is already live here")
        self.live_reqs[req.rid] = req
        req.stage = Stage.WAITING
        req.mark("waiting")
        self.waiting_queue.append(req)

    def take_from_waiting(self, reqs: Iterable[Req]) -> None:
        picked = set(map(id, reqs))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in picked]

    def dequeue(self, req: Req) -> None:
        """Take a request out of the container its stage says holds it (Stage.NEW outside the grammar
        queue: a role's queue, which `on_release` empties)."""
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

    # ------------------------------------------------------------------ counts
    def num_running_slots_used(self) -> int:
        """The running batch, the request being chunked, and ended requests whose memory waits for a
        forward in flight (overlap scheduling)."""
        deferred = self._deferred() if self._deferred is not None else 0
        return len(self.running_batch.reqs) + (1 if self.chunked_req is not None else 0) + deferred

    def num_queued(self) -> int:
        """Requests that are not running yet (--max-queued-requests counts them): the waiting queue
        (retracted requests included) and those a role keeps in its own queues before they run."""
        return len(self.waiting_queue) + sum(1 for r in self.live_reqs.values() if r.stage is Stage.NEW)

    def has_unfinished(self) -> bool:
        """Requests waiting, being chunked or running (not those only a role holds)."""
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req is not None)

    def counts(self) -> dict[str, int]:
        return {"waiting": len(self.waiting_queue), "running": len(self.running_batch.reqs),
                "chunked": 1 if self.chunked_req is not None else 0}
