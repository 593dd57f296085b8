"""The managers' leak counters (`leak_stats`, shown in a node's /server_info and /metrics): open and
draining rooms and registrations come back to zero, and a registration with no room for
`peer_idle_timeout` seconds is dropped (with its engine peer and socket), after which the next room
registers again and succeeds."""

from __future__ import annotations

import pytest

from tests.transfer.inproc_pair import Pair, engine_or_skip, wait
from transfer.base import KVPoll
from transfer.receiver import KVReceiver
from transfer.sender import KVSender

KEYS = ("transfer_rooms_open", "transfer_rooms_draining", "transfer_peers_registered",
        "transfer_engine_peers")


def counters(mgr) -> dict:
    return {k: v for k, v in mgr.leak_stats().items() if k in KEYS}


@pytest.mark.parametrize("backend", ["fake", "nixl"])
def test_counters_and_idle_registrations_expire(backend):
    pair = Pair(engine_or_skip(backend), engine_or_skip(backend), peer_idle_timeout=1.5)
    try:
        p, d = pair.prefill, pair.decode
        assert counters(p) == {k: 0 for k in KEYS}
        recv_room = 11
        send, recv = pair.start(recv_room, [1, 2], [3, 4])
        assert p.leak_stats()["transfer_rooms_open"] == 1 and d.leak_stats()["transfer_rooms_open"] == 1
        send.send([1, 2], [0], last=True)
        assert wait(lambda: send.poll() == KVPoll.Success and recv.poll() == KVPoll.Success)
        assert wait(lambda: counters(p)["transfer_peers_registered"] == 1
                    and counters(p)["transfer_engine_peers"] == 1)
        assert counters(p)["transfer_rooms_open"] == 0 and counters(d)["transfer_rooms_open"] == 0
        assert counters(d)["transfer_peers_registered"] == 1  # the decode registered with one prefill rank

        # no room for longer than peer_idle_timeout: both sides forget the other
        assert wait(lambda: counters(p)["transfer_peers_registered"] == 0 and
                    counters(d)["transfer_peers_registered"] == 0, timeout=10)
        assert wait(lambda: counters(p)["transfer_engine_peers"] == 0)
        assert p.guard_stats()["control_registrations_expired"] == 1
        assert d.guard_stats()["control_registrations_expired"] == 1

        # the next room registers again and is delivered byte for byte
        send, recv = pair.transfer(12, [5, 6], [7, 8])
        assert send.poll() == KVPoll.Success and recv.poll() == KVPoll.Success
        assert pair.pages_hold([7, 8], [5, 6]) or not p.moves_bytes
        assert counters(p)["transfer_peers_registered"] == 1 and counters(d)["transfer_peers_registered"] == 1
    finally:
        pair.close()


def test_a_rank_declared_dead_is_not_resolved_again_from_a_stale_answer():
    """A crashed prefill node's bootstrap server can answer with its dead rank for a moment (and the
    decode's cache keeps that answer): rooms resolved from it would send their TransferInfo into the
    void. The decode asks again until the rank registers a new address."""
    pair = Pair(engine_or_skip("fake"), engine_or_skip("fake"))
    try:
        p, d = pair.prefill, pair.decode
        send, recv = pair.transfer(21, [1], [2])
        assert recv.poll() == KVPoll.Success
        with d._lock:
            d._on_peer_dead(p.address, [], "test: declared dead")
        recv = KVReceiver(d, pair.addr, 22)
        recv.init([3], 0, [0])
        # the resolver's passes see the dead address (how soon depends on the machine's load: CI once took
        # longer than 1.5 s) and keep the room resolving
        assert wait(lambda: "declared dead" in recv._problem, timeout=10), recv._problem
        assert not wait(lambda: recv.poll() != KVPoll.Bootstrapping, timeout=0.5)
        with d._lock:
            d._dead_peers.clear()  # as if the restarted rank had registered a new address
        send = KVSender(p, 22)
        send.init(1, 0)
        send.send([1], [0], last=True)
        assert wait(lambda: recv.poll() == KVPoll.Success and send.poll() == KVPoll.Success)
    finally:
        pair.close()
