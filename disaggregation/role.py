"""`PDRole`: the scheduler hooks (common/scheduler/hooks.py) the prefill and decode roles build on.

A role keeps every request it holds in `requests`, by rid: one `PDRequest` from arrival until the
role lets it go (disaggregation/requests.py). What the two roles do alike lives here:

* `validate`: a PD request carries a rendezvous the transfer can use (bootstrap host, port and a
  room no other request of this node holds) and asks for no more first-token top logprobs than the
  metadata row carries;
* `poll`: one poll of the given requests' senders or receivers, the MIN over the TP consensus group,
  so every rank moves its requests in the same iteration; a failure on any rank ends the request on
  every rank (`fail`, HTTP 500) with the reason the rank that saw it gives;
* `release_conn` and `forget`, when a request ends: its sender or receiver is aborted unless its
  transfer is over, and its PD state and metadata slot go;
* `guarded(t, what, fn)`: one request's step of a hook; an exception fails that request only (500,
  one log record with the rid and the traceback), never the scheduler.

A subclass maps stages to its queues (`queue_of`), sets `kv_manager` and frees its own memory in
`on_release`. Counting is `TransferStats`' (disaggregation/stats.py).
"""

from __future__ import annotations

import logging
from typing import Any

from common.protocol import KV_TRANSFER_FAILED
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.req import FinishStatus, Req
from disaggregation.requests import MAX_ROOM, MAX_TOP_LOGPROBS, PDRequest, StageQueue
from disaggregation.stats import TransferStats
from transfer.base import KVPoll
from transfer.consensus import poll_and_all_reduce, share_failure_reasons


def failure_reason(poller) -> str:
    """Why a room failed; the consensus may report a failure another TP rank saw first."""
    if poller.poll() == KVPoll.Failed:
        return str(poller.failure_exception())
    return f"room {poller.room}: the transfer failed on another TP rank of this node (see its log)"


class PDRole(SchedulerHooks):
    """Scheduler hooks shared by the prefill and decode roles (`role` "prefill" or "decode")."""

    role = "pd"
    logger = logging.getLogger("pd")

    def __init__(self, sched, metadata_alloc) -> None:
        from common.distributed import get_consensus_group

        self.sched = sched
        self.consensus_group = get_consensus_group()
        self.metadata_alloc = metadata_alloc
        self.requests: dict[str, PDRequest] = {}
        self.transfer_stats = TransferStats(guard=self.guard_stats)

    def validate(self, req: Req) -> tuple[int, str] | None:
        if req.bootstrap_host is None or req.bootstrap_port is None or req.bootstrap_room is None:
            return 400, (f"this is a {self.role} node; requests need bootstrap_host/bootstrap_port/"
                         "bootstrap_room (send them through a PD router)")
        if not 0 <= req.bootstrap_room <= MAX_ROOM:
            return 400, (f"bootstrap_room must be 0..{MAX_ROOM} (it travels as an int64), "
                         f"got {req.bootstrap_room}")
        if not 1 <= req.bootstrap_port <= 65535:
            return 400, f"bootstrap_port must be 1..65535, got {req.bootstrap_port}"
        owner = next((t.rid for t in self.requests.values() if t.room == req.bootstrap_room), None)
        if owner is not None:
            return 400, f"bootstrap_room {req.bootstrap_room} is already in use by request {owner}"
        if req.top_logprobs_num > MAX_TOP_LOGPROBS:
            return 400, (f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS} on a PD cluster, "
                         f"got {req.top_logprobs_num}")
        return None  # then the scheduler's own checks, with the client's max_new_tokens, so both legs agree

    def guard_stats(self) -> dict[str, int]:
        """The rank's control plane's counters and, on the rank that runs it, the bootstrap server's."""
        out: dict[str, int] = {}
        for source in (getattr(self, "kv_manager", None), getattr(self, "bootstrap_server", None)):
            counters = getattr(source, "guard_stats", None)
            if counters is not None:
                out.update(counters())
        return out

    def queue_of(self, t: PDRequest) -> StageQueue | None:
        """The role's queue for the request's stage (None: the scheduler holds it)."""
        raise NotImplementedError

    def poll(self, states: list[PDRequest]) -> dict[str, KVPoll]:
        """One TP-wide poll (MIN over the consensus group) of the given requests' senders/receivers;
        those that failed (on any rank) are ended here."""
        agreed = poll_and_all_reduce([t.conn for t in states], self.consensus_group)
        polls = dict(zip([t.rid for t in states], agreed, strict=True))
        failed = [t for t in states if polls[t.rid] == KVPoll.Failed]
        if failed:  # every rank got the same polls, so every rank shares its reasons here
            own = [str(t.conn.failure_exception()) if t.conn.poll() == KVPoll.Failed else None
                   for t in failed]
            for t, reason in zip(failed, share_failure_reasons(own, self.consensus_group), strict=True):
                self.fail(t, reason or failure_reason(t.conn))
        return polls

    def fail(self, t: PDRequest, reason: str) -> None:
        """The transfer failed: end the request (HTTP 500) wherever it is; `on_release` frees the rest."""
        t.failed = True
        self.transfer_stats.failure(t.before_transfer)
        self.logger.warning("rid=%s room=%d transfer failed at stage %s: %s", t.rid, t.room, t.stage.value,
                            reason)
        self.sched.finish_requests(t.rid, FinishStatus.abort(f"KV transfer failed: {reason}", 500,
                                                                 err_type=KV_TRANSFER_FAILED))

    def guarded(self, t: PDRequest, what: str, fn, *args):
        """One request's step: `fn(*args)`'s result; an exception fails that request only (None)."""
        try:
            return fn(*args)
        except Exception:
            self.logger.exception("rid=%s room=%d %s failed; the request fails", t.rid, t.room, what)
            why = f"internal error while {what} (see the node's log)"
            self.sched.finish_requests(t.rid, FinishStatus.abort(why, 500))
            return None

    def pd_stats(self) -> dict[str, Any]:
        """The transfer counters both roles report."""
        return {**self.transfer_stats.as_stats(), "pd_requests_open": len(self.requests),
                "rejected_peer_values": getattr(self.kv_manager, "rejected_peer_values", 0)}

    def forget(self, t: PDRequest) -> None:
        """Drop the request's PD state: out of its queue, its metadata slot freed."""
        self.requests.pop(t.rid, None)
        q = self.queue_of(t)
        if q is not None:
            q.discard(t)
        if t.metadata_index is not None:
            self.metadata_alloc.free(t.metadata_index)
            t.metadata_index = None

    def release_conn(self, t: PDRequest) -> None:
        """Abort the sender/receiver unless its transfer already ended; a failure the poll did not
        see yet (the request ended another way first) is counted here."""
        state = t.conn.poll()
        if state == KVPoll.Failed and not t.failed:
            t.failed = True
            self.transfer_stats.failure(t.before_transfer)
            self.logger.warning("rid=%s room=%d transfer had failed when the request ended: %s", t.rid,
                                t.room, failure_reason(t.conn))
        elif state not in (KVPoll.Success, KVPoll.Failed):
            self.transfer_stats.aborts += 1
            t.conn.abort()
