"""No late write into freed pages: the decode keeps an aborted room's memory out of use until the
prefill acknowledges that no chunk job of the room can still write (AbortAck), or the prefill rank
is declared dead.

The race, made wide and deterministic: room 1's only write is held inside the prefill's engine
(`GatedEngine`) while the decode aborts the room; the decode then hands memory to room 2 the way
its allocator does (last freed, first reused) and room 2's bytes arrive; then room 1's write is let
go. With the quarantine, room 2 never got room 1's pages and its bytes stay exact; under the old
rule (memory back at once on abort) room 2 gets exactly room 1's pages, metadata row and state
slot, and the late write overwrites them — `test_without_the_quarantine_a_late_write_corrupts`
shows that this setup does catch the corruption, i.e. that the first test fails on the old code.
"""

from __future__ import annotations

import logging

import pytest

from tests.transfer.inproc_pair import GatedEngine, Pair, engine_or_skip, wait
from transfer.base import KVPoll

BACKENDS = ["mooncake", "nixl"]


class Slots:
    """A LIFO free list like the node's allocator (the slot freed last is handed out first); memory
    given back with a receiver returns only once `reusable(receiver)`."""

    def __init__(self, items: list[int], reusable) -> None:
        self.free = list(reversed(items))
        self.total = len(items)
        self.reusable = reusable
        self.held: list[tuple[object, list[int]]] = []

    def alloc(self, n: int) -> list[int]:
        self.collect()
        out = self.free[-n:][::-1]
        del self.free[-n:]
        return out

    def give_back(self, receiver, items: list[int]) -> None:
        self.held.append((receiver, items))
        self.collect()

    def collect(self) -> None:
        keep = []
        for receiver, items in self.held:
            if self.reusable(receiver):
                self.free.extend(reversed(items))
            else:
                keep.append((receiver, items))
        self.held = keep


def drained(receiver) -> bool:
    return receiver.drain_poll() == KVPoll.Success


@pytest.fixture(params=BACKENDS)
def gated_pair(request):
    gate = GatedEngine(engine_or_skip(request.param))
    pair = Pair(gate, engine_or_skip(request.param))
    pair.gate = gate
    yield pair
    gate.fail()
    pair.close()


def _race(pair: Pair, reusable):
    """Room 1 aborted while its write is held; room 2 gets memory from the free lists and its bytes;
    returns (room 2's pages, metadata row, state slot, room 1's pages, room 2's receiver)."""
    gate = pair.gate
    pages = Slots(list(range(1, 32)), reusable)
    rows, states = Slots(list(range(8)), reusable), Slots(list(range(6)), reusable)
    dst1, row1, st1 = pages.alloc(8), rows.alloc(1)[0], states.alloc(1)[0]
    send1, recv1 = pair.start(101, list(range(1, 9)), dst1, src_meta=0, dst_meta=row1,
                              src_state=0, dst_state=st1)
    gate.arm()
    send1.send(list(range(1, 9)), [0], last=True)
    assert gate.entered.wait(20), "room 1's write never reached the engine"
    recv1.abort()
    assert wait(lambda: send1.poll() == KVPoll.Failed), "the prefill never saw the abort"
    assert not gate.done.is_set()
    pages.give_back(recv1, dst1)
    rows.give_back(recv1, [row1])
    states.give_back(recv1, [st1])
    dst2, row2, st2 = pages.alloc(8), rows.alloc(1)[0], states.alloc(1)[0]
    send2, recv2 = pair.start(102, list(range(11, 19)), dst2, src_meta=1, dst_meta=row2,
                              src_state=3, dst_state=st2)
    send2.send(list(range(11, 19)), [3], last=True)
    assert wait(lambda: recv2.poll() == KVPoll.Success and send2.poll() == KVPoll.Success), \
        (recv2.poll(), send2.poll())
    assert pair.pages_hold(dst2, list(range(11, 19))) and pair.state_holds(st2, 3) \
        and pair.row_room(row2) == 102
    return (dst2, row2, st2, dst1, recv1, recv2, (pages, rows, states))


def test_an_aborted_rooms_pages_wait_for_the_abort_ack(gated_pair):
    pair, gate = gated_pair, gated_pair.gate
    dst2, row2, st2, dst1, recv1, recv2, pools = _race(pair, drained)
    assert not set(dst2) & set(dst1), "room 2 got pages room 1's write may still land in"
    assert recv1.drain_poll() == KVPoll.Transferring and pair.decode._draining
    assert all(len(p.held) == 1 for p in pools)  # room 1's pages, row and state slot wait
    gate.release()  # room 1's late write lands now, in its own quarantined pages
    assert gate.done.wait(20)
    assert wait(lambda: drained(recv1)), "no AbortAck after the write ended"
    assert pair.pages_hold(dst2, list(range(11, 19))), "room 2's pages were overwritten"
    assert pair.state_holds(st2, 3) and pair.row_room(row2) == 102
    for p, items in zip(pools, (dst2, [row2], [st2]), strict=True):
        p.give_back(recv2, items)  # room 2 is done with them (Success: no drain)
        assert len(p.free) == p.total and not p.held
    assert pair.pages_hold(dst1, list(range(1, 9)))  # the late write did land, where nobody reads
    assert wait(pair.idle) and pair.threads_alive()
    assert pair.prefill.rejected_peer_values == 0 and pair.decode.rejected_peer_values == 0


def test_without_the_quarantine_a_late_write_corrupts(gated_pair):
    """The old rule (memory reused as soon as the room is aborted) on the same race: room 2 is handed
    room 1's very pages, row and slot, and the released write overwrites room 2's bytes."""
    pair, gate = gated_pair, gated_pair.gate
    dst2, row2, st2, dst1, *_ = _race(pair, lambda receiver: True)
    assert dst2 == dst1
    gate.release()
    assert gate.done.wait(20)
    assert not pair.pages_hold(dst2, list(range(11, 19)))
    assert pair.row_room(row2) == 101 and not pair.state_holds(st2, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_ack_from_a_live_peer_holds_the_pages_until_the_timeout(backend, caplog):
    gate = GatedEngine(engine_or_skip(backend))
    pair = Pair(gate, engine_or_skip(backend), abort_ack_timeout=1.5)
    try:
        send1, recv1 = pair.start(201, [1, 2, 3], [4, 5, 6])
        gate.arm()
        send1.send([1, 2, 3], [0], last=True)
        assert gate.entered.wait(20)
        with caplog.at_level(logging.INFO, logger="transfer.receiver"):
            recv1.abort()
            aborted = pair.decode.settings.abort_ack_timeout
            assert wait(lambda: send1.poll() == KVPoll.Failed)
            assert not wait(lambda: drained(recv1), timeout=1.0), "released before the ack timeout"
            assert wait(lambda: drained(recv1), timeout=10), "never released after the ack timeout"
        dead = [r for r in caplog.records if "sent no AbortAck" in r.getMessage()]
        assert len(dead) == 1 and "room(s) [201]" in dead[0].getMessage() and aborted == 1.5
        assert pair.prefill.address not in pair.decode._registered_with  # declared dead: forgotten
        gate.release()
        assert gate.done.wait(20)
        # the rank is still there: a new room registers again and moves its bytes exactly
        _, recv2 = pair.transfer(202, [7, 8], [9, 10], src_state=1, dst_state=2)
        assert recv2.poll() == KVPoll.Success and pair.pages_hold([9, 10], [7, 8]) and pair.state_holds(2, 1)
        assert wait(pair.idle) and pair.threads_alive()
    finally:
        gate.fail()
        pair.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_prefill_ends_the_quarantine(backend):
    gate = GatedEngine(engine_or_skip(backend))
    pair = Pair(gate, engine_or_skip(backend), heartbeat_interval=0.2, heartbeat_max_failures=3)
    try:
        send1, recv1 = pair.start(301, [1, 2], [3, 4])
        gate.arm()
        send1.send([1, 2], [0], last=True)
        assert gate.entered.wait(20)
        recv1.abort()
        assert not wait(lambda: drained(recv1), timeout=0.5)
        pair.prefill.control._stop.set()  # its receiver stops: no Pong, dead after the heartbeat window
        assert wait(lambda: drained(recv1), timeout=10)
        assert not pair.decode._draining
    finally:
        gate.fail()
        pair.close()
