"""A connection to a decode rank that stays broken until the engine forgets the peer.

After a partition heals, nixl keeps failing every write to the decode agent it lost
(NIXL_ERR_REMOTE_DISCONNECT) until the remote agent is removed and loaded again: `pdserve bench
netfaults` found a decode host that never served again. `StickyEngine` plays that engine over a real
one: once `break_peer()` is called, writes to the peer fail until `remove_peer` drops it. The prefill
side must forget a decode rank whose write failed, so that rank's next room finds it unregistered,
registers again and the engine connects afresh; the room after the failure then arrives whole.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from tests.transfer.inproc_pair import Pair, engine_or_skip
from transfer.base import KVPoll
from transfer.engine import TransferEngine, TransferError


class StickyEngine(TransferEngine):
    def __init__(self, inner: TransferEngine) -> None:
        super().__init__(inner.hostname, inner.device_name)
        self.inner = inner
        self.name = f"sticky-{inner.name}"
        self.moves_bytes = getattr(inner, "moves_bytes", True)
        self._lock = threading.Lock()
        self.broken: set[str] = set()
        self.peers: set[str] = set()
        self.added = 0

    def break_peer(self) -> None:
        with self._lock:
            self.broken |= self.peers

    def register(self, ptr: int, length: int, memory: str = "host") -> None:
        self.inner.register(ptr, length, memory)

    def describe(self) -> bytes:
        return self.inner.describe()

    def add_peer(self, description: bytes) -> str:
        peer = self.inner.add_peer(description)
        with self._lock:
            self.peers.add(peer)
            self.added += 1
        return peer

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self.broken.discard(peer)
            self.peers.discard(peer)
        self.inner.remove_peer(peer)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = "host", dst_memory: str = "host") -> None:
        with self._lock:
            broken = peer in self.broken
        if broken:
            raise TransferError(f"write to {peer} failed: REMOTE_DISCONNECT (the test's broken connection)")
        self.inner.write(peer, src, dst, lengths, src_memory, dst_memory)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_decode_rank_whose_write_failed_registers_again_and_is_served(backend):
    engine = StickyEngine(engine_or_skip(backend))
    pair = Pair(engine, engine_or_skip(backend))
    try:
        send, recv = pair.transfer(1, [1, 2], [2, 3])
        assert (send.poll(), recv.poll()) == (KVPoll.Success, KVPoll.Success)
        assert engine.added == 1
        engine.break_peer()
        send, recv = pair.transfer(2, [1, 2], [4, 5])
        assert (send.poll(), recv.poll()) == (KVPoll.Failed, KVPoll.Failed)
        assert "REMOTE_DISCONNECT" in str(recv.failure_exception())
        for room, dst in ((3, [6, 7]), (4, [8, 9])):  # registered again: a fresh engine peer, whole pages
            send, recv = pair.transfer(room, [1, 2], dst)
            assert (send.poll(), recv.poll()) == (KVPoll.Success,
                                                  KVPoll.Success), str(recv.failure_exception())
            assert pair.pages_hold(dst, [1, 2])
        assert engine.added == 2 and not engine.broken
    finally:
        pair.close()
