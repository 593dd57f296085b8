"""The PD roles' queues and their shared state, without a model or a transfer engine: stand-in senders
and receivers report a KVPoll, a stand-in scheduler records what the role asks of it."""

from __future__ import annotations

from common.protocol import SamplingParams
from common.scheduler.req import Req
from decode_node.queues import DecodeRequest, DecodeStage, PreallocQueue, TransferQueue, WaitingQueue
from disaggregation.role import PDRole
from prefill_node.queues import BootstrapQueue, InflightQueue, PrefillRequest, PrefillStage
from transfer.base import KVPoll
from transfer.metadata import MetadataAllocator


class Conn:
    def __init__(self, room: int, state: KVPoll = KVPoll.Bootstrapping) -> None:
        self.room = room
        self.state = state
        self.inits: list = []
        self.aborted = False

    def init(self, *args, **kw) -> None:
        self.inits.append(args)

    def poll(self) -> KVPoll:
        return self.state

    def failure_exception(self) -> Exception:
        return RuntimeError(f"room {self.room} broke")

    def abort(self) -> None:
        self.aborted = True


def req(rid: str, room: int | None = None, top: int = 0) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), top_logprobs_num=top, bootstrap_host="h",
               bootstrap_port=1, bootstrap_room=room)


def prefill_state(rid: str, room: int) -> PrefillRequest:
    return PrefillRequest(req=req(rid, room), room=room, conn=Conn(room), num_pages=3)


def test_bootstrap_queue_assigns_slots_first_come_and_hands_on_the_ready():
    slots = MetadataAllocator(2)
    q = BootstrapQueue(slots)
    a, b, c = (prefill_state(r, i) for i, r in enumerate("abc"))
    for t in (a, b, c):
        q.add(t)
    assert all(t.stage is PrefillStage.BOOTSTRAP for t in (a, b, c))
    q.init_senders()
    assert (a.metadata_index, b.metadata_index, c.metadata_index) == (0, 1, None)
    assert a.conn.inits == [(3, 0)] and c.conn.inits == []
    polls = {"a": KVPoll.Bootstrapping, "b": KVPoll.WaitingForInput, "c": KVPoll.WaitingForInput}
    ready = q.take_ready(polls)
    assert ready == [b] and b.stage is PrefillStage.WAITING  # c has no metadata slot yet
    assert list(q) == [a, c] and len(q) == 2
    slots.free(1)
    q.init_senders()
    assert q.take_ready(polls) == [c] and c.metadata_index == 1 and list(q) == [a]


def test_inflight_queue_hands_on_the_done():
    q = InflightQueue()
    a, b = prefill_state("a", 1), prefill_state("b", 2)
    q.add(a)
    q.add(b)
    assert a.stage is PrefillStage.INFLIGHT
    assert q.take_done({"a": KVPoll.Transferring, "b": KVPoll.Success}) == [b]
    assert list(q) == [a]


def test_decode_queues_move_requests_on():
    pre, xfer, wait = PreallocQueue(), TransferQueue(), WaitingQueue()
    ts = [DecodeRequest(req=req(r, i), room=i, conn=Conn(i)) for i, r in enumerate("abcd")]
    for t in ts:
        pre.add(t)
    polls = {"a": KVPoll.WaitingForInput, "b": KVPoll.Bootstrapping, "c": KVPoll.WaitingForInput,
             "d": KVPoll.Transferring}
    assert pre.resolved(polls) == [ts[0], ts[2], ts[3]]
    for t in pre.resolved(polls):
        pre.move(t, xfer)
    assert list(pre) == [ts[1]] and all(t.stage is DecodeStage.TRANSFER for t in xfer)
    polls.update(a=KVPoll.Success, d=KVPoll.Success)
    for t in xfer.arrived(polls):
        xfer.move(t, wait)
    assert list(wait) == [ts[0], ts[3]] and ts[3].stage is DecodeStage.WAITING and list(xfer) == [ts[2]]
    # admission asks again after each admitted request: one slot left
    slots = [1]

    def can_admit() -> bool:
        return slots[0] > 0

    admitted = []
    for t in wait.admit(can_admit):
        admitted.append(t)
        slots[0] -= 1
    assert admitted == [ts[0]] and list(wait) == [ts[3]]


class FakeScheduler:
    def __init__(self) -> None:
        self.finished: list = []

    def finish_requests(self, rid, status) -> None:
        self.finished.append((rid, status.reason["message"], status.error_status))


class Role(PDRole):
    role = "prefill"

    def __init__(self) -> None:
        super().__init__(FakeScheduler(), MetadataAllocator(4))
        self.queue = BootstrapQueue(self.metadata_alloc)

    def queue_of(self, t):
        return self.queue


def test_pd_role_checks_rooms_polls_and_forgets():
    role = Role()
    a, b = prefill_state("a", 7), prefill_state("b", 8)
    for t in (a, b):
        role.requests[t.rid] = t
        role.queue.add(t)
    role.queue.init_senders()
    assert role.validate(req("x", None))[0] == 400  # no bootstrap room
    status, msg = role.validate(req("x", 7))
    assert status == 400 and "already in use by request a" in msg
    assert role.validate(req("x", 9, top=21))[0] == 400
    assert role.validate(req("x", 9)) is None
    b.conn.state = KVPoll.Failed
    polls = role.poll([a, b])
    assert polls == {"a": KVPoll.Bootstrapping, "b": KVPoll.Failed}
    assert role.sched.finished == [("b", "KV transfer failed: room 8 broke", 500)]
    assert role.transfer_stats.failures == 1
    role.release_conn(a)
    role.forget(a)
    assert a.conn.aborted and "a" not in role.requests and list(role.queue) == [b]
    assert a.metadata_index is None and role.metadata_alloc.available() == 3
    assert role.validate(req("x", 7)) is None  # the room is free again
