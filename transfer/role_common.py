"""What the prefill and decode roles share: the rank's KV manager over the runner's pools, the
advertised address, the transfer counters, a request's PD state and the queues of its stages, and
`PDRole`, the scheduler hooks (`common/scheduler/hooks.py`) both roles build on.

`PDRole` keeps every request of the role in `requests`, by rid: one `PDRequest` (stage, room,
sender or receiver, metadata slot) from arrival until the role lets it go. Its stages' queues are
`StageQueue`s; adding a request to one sets its stage, so the stage says which queue holds it.

Counting. `transfer_failures` counts every request whose transfer failed on this node: ended by
the poll (`fail`), or ended another way (an abort that arrived in the same iteration as the failure,
say the router's abort of the decode leg after the prefill leg failed) while its sender/receiver
had already failed here. `transfer_aborts` counts transfers this node gave up while they were still
healthy (client or router abort, request refused or ended for another reason). Each request counts
once, in one of them or in `transfer_successes`. `rejected_peer_values` is the manager's count of
peer messages refused by a check (`transfer/peer_checks.py`).

Robustness. `guarded(t, what, fn)` runs one request's step of a role hook; an exception fails that
request only (500, one log record with the rid and the traceback).
"""

from __future__ import annotations

import enum
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from common.histogram import BucketCounts
from common.protocol import KV_TRANSFER_FAILED
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.req import FinishStatus, Req
from transfer.base import KVArgs, KVPoll, TransferSettings
from transfer.consensus import poll_and_all_reduce, share_failure_reasons
from transfer.manager import KVManager
from transfer.metadata import MetadataBuffers
from transfer.receiver import DecodeKVManager
from transfer.sender import PrefillKVManager

# first-token top logprobs carried from prefill to decode (requests asking for more are refused)
MAX_TOP_LOGPROBS = 20
MAX_ROOM = (1 << 63) - 1  # rooms travel in an int64 metadata field

MANAGERS: dict[str, type[KVManager]] = {"prefill": PrefillKVManager, "decode": DecodeKVManager}


def advertised_host(host: str) -> str:
    """An address peers can reach for a listening host setting ("0.0.0.0" is not one)."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def build_kv_manager(args, runner, metadata: MetadataBuffers, tp_rank: int, tp_size: int, role: str,
                     bootstrap_addr: str | None = None, dp_rank: int = 0) -> KVManager:
    """The `role`'s KV manager for this rank's share of the KV heads (and hybrid state) of its pipeline
    stage's layers in DP group `dp_rank`, with the node's timeouts (flags win over the environment); a prefill rank passes its
    `bootstrap_addr`."""
    stage = {}
    if getattr(runner, "pp_size", 1) > 1:  # a pipeline stage sends its own layers (KVArgs' layer ids place them)
        stage = {"pp_rank": runner.pp_rank, "pp_size": runner.pp_size}
    kv_args = KVArgs.from_runner(runner, metadata, engine_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank,
                                 dp_size=getattr(args, "dp_size", 1), **stage)
    if role == "prefill":
        kv_args.decode_tp = getattr(args, "disaggregation_decode_tp", None) or 0
    where = {"bootstrap_addr": bootstrap_addr} if bootstrap_addr else {}
    return MANAGERS[role](kv_args, args.transfer_backend, settings=node_settings(args),
                          host=advertised_host(args.host), **where)


def node_settings(args) -> TransferSettings:
    """The transfer settings of a node: the environment's, with the node's flags winning. A wildcard
    --host asked for every interface, which acknowledges mooncake's wildcard listeners as the flag does."""
    wildcard_ok = getattr(args, "transfer_allow_wildcard_listen", False) or args.host in ("", "0.0.0.0", "::")
    return TransferSettings.from_env(bootstrap_timeout=args.disaggregation_bootstrap_timeout,
                                     waiting_timeout=args.disaggregation_waiting_timeout,
                                     device_name=args.disaggregation_ib_device,
                                     cluster_secret=getattr(args, "cluster_secret", None),
                                     allow_wildcard_listen=True if wildcard_ok else None)


@dataclass
class TransferStats:
    failures: int = 0
    failures_bootstrap: int = 0  # of `failures`: before any KV moved (rendezvous, TransferInfo, prealloc)
    aborts: int = 0
    successes: int = 0
    bytes: int = 0
    latency_sum: float = 0.0
    latency_last: float = 0.0
    # the planes' guard counters (dropped messages by cause, refused registrations, open sockets)
    guard: Callable[[], dict[str, int]] | None = field(default=None, repr=False, compare=False)

    latency_hist: BucketCounts = field(default_factory=BucketCounts, repr=False, compare=False)

    def success(self, nbytes: int, latency: float) -> None:
        self.successes += 1
        self.bytes += nbytes
        self.latency_sum += latency
        self.latency_last = latency
        self.latency_hist.observe(latency)

    def as_stats(self) -> dict[str, float]:
        n = self.successes
        return {"transfer_failures": self.failures, "transfer_failures_bootstrap": self.failures_bootstrap,
                "transfer_aborts": self.aborts, "transfer_successes": n,
                "transfer_latency_hist": self.latency_hist.as_stats(),
                "transfer_bytes": self.bytes,
                "transfer_latency_avg_s": self.latency_sum / n if n else 0.0,
                "transfer_latency_last_s": self.latency_last, **(self.guard() if self.guard else {})}


def failure_reason(poller) -> str:
    """Why a room failed; the consensus may report a failure another TP rank saw first."""
    if poller.poll() == KVPoll.Failed:
        return str(poller.failure_exception())
    return f"room {poller.room}: the transfer failed on another TP rank of this node (see its log)"


# the stages (prefill, decode) in which no KV has moved yet: a failure there is a bootstrap failure
# (reference 001 §15.1 counts those apart from failures of the transfer itself)
BEFORE_TRANSFER = frozenset({"bootstrap", "prealloc"})


@dataclass(kw_only=True)
class PDRequest:
    """A request's PD state on one rank: its stage, its room, its sender or receiver (`conn`), and the
    metadata slot it holds."""

    req: Req
    room: int
    conn: Any
    stage: enum.Enum
    metadata_index: int | None = None
    created: float = field(default_factory=time.monotonic)
    failed: bool = False  # counted as a transfer failure

    @property
    def rid(self) -> str:
        return self.req.rid


class StageQueue:
    """The requests of one stage, oldest first. `add` sets the request's stage; a role's subclasses
    move their requests on."""

    stage: enum.Enum

    def __init__(self) -> None:
        self._reqs: dict[str, PDRequest] = {}

    def add(self, t: PDRequest) -> None:
        t.stage = self.stage
        t.req.mark(self.stage.value)
        self._reqs[t.rid] = t

    def discard(self, t: PDRequest) -> None:
        self._reqs.pop(t.rid, None)

    def move(self, t: PDRequest, to: StageQueue) -> None:
        """The request moves on to the next stage's queue."""
        self.discard(t)
        to.add(t)

    def __iter__(self) -> Iterator[PDRequest]:
        return iter(list(self._reqs.values()))

    def __len__(self) -> int:
        return len(self._reqs)


class PDRole(SchedulerHooks):
    """Scheduler hooks shared by the prefill and decode roles (`role` "prefill" or "decode"). A
    subclass maps stages to its queues (`queue_of`) and frees its own memory in `on_release`."""

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
            return 400, f"bootstrap_room must be 0..{MAX_ROOM} (it travels as an int64), got {req.bootstrap_room}"
        if not 1 <= req.bootstrap_port <= 65535:
            return 400, f"bootstrap_port must be 1..65535, got {req.bootstrap_port}"
        owner = next((t.rid for t in self.requests.values() if t.room == req.bootstrap_room), None)
        if owner is not None:
            return 400, f"bootstrap_room {req.bootstrap_room} is already in use by request {owner}"
        if req.top_logprobs_num > MAX_TOP_LOGPROBS:
            return 400, f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS} on a PD cluster, got {req.top_logprobs_num}"
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
        polls = dict(zip([t.rid for t in states], poll_and_all_reduce([t.conn for t in states], self.consensus_group),
                         strict=True))
        failed = [t for t in states if polls[t.rid] == KVPoll.Failed]
        if failed:  # every rank got the same polls, so every rank shares its reasons here
            own = [str(t.conn.failure_exception()) if t.conn.poll() == KVPoll.Failed else None for t in failed]
            for t, reason in zip(failed, share_failure_reasons(own, self.consensus_group), strict=True):
                self.fail(t, reason or failure_reason(t.conn))
        return polls

    def fail(self, t: PDRequest, reason: str) -> None:
        """The transfer failed: end the request (HTTP 500) wherever it is; `on_release` frees the rest."""
        t.failed = True
        self.transfer_stats.failures += 1
        if t.stage.value in BEFORE_TRANSFER:
            self.transfer_stats.failures_bootstrap += 1
        self.logger.warning("rid=%s room=%d transfer failed at stage %s: %s", t.rid, t.room, t.stage.value, reason)
        self.sched.finish_requests(t.rid, FinishStatus.abort(f"KV transfer failed: {reason}", 500,
                                                                 err_type=KV_TRANSFER_FAILED))

    def guarded(self, t: PDRequest, what: str, fn, *args):
        """One request's step: `fn(*args)`'s result; an exception fails that request only (None)."""
        try:
            return fn(*args)
        except Exception:
            self.logger.exception("rid=%s room=%d %s failed; the request fails", t.rid, t.room, what)
            self.sched.finish_requests(t.rid, FinishStatus.abort(f"internal error while {what} (see the node's log)",
                                                                 500))
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
            self.transfer_stats.failures += 1
            if t.stage.value in BEFORE_TRANSFER:
                self.transfer_stats.failures_bootstrap += 1
            self.logger.warning("rid=%s room=%d transfer had failed when the request ended: %s", t.rid, t.room,
                                failure_reason(t.conn))
        elif state not in (KVPoll.Success, KVPoll.Failed):
            self.transfer_stats.aborts += 1
            t.conn.abort()
