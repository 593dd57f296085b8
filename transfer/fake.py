"""The `fake` backend: an engine that moves no bytes.

Everything above the engine still runs for real (bootstrap, control plane, TransferInfo, chunk
planning, heartbeats, timeouts, failure injection, the state machine), so schedulers can be tested
end to end without a transfer library. `moves_bytes = False` tells the receiver not to check the
metadata row's room (nothing was written into it).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

from transfer.engine import TransferEngine, TransferError


class FakeEngine(TransferEngine):
    name = "fake"
    moves_bytes = False

    def __init__(self, hostname: str = "127.0.0.1", device_name: str | None = None) -> None:
        super().__init__(hostname, device_name)
        self._id = f"fake:{hostname}:{uuid.uuid4().hex}"
        self._regions: list[tuple[int, int]] = []
        self._peers: set[str] = set()
        self._lock = threading.Lock()
        self.bytes_skipped = 0

    def register(self, ptr: int, length: int) -> None:
        with self._lock:
            self._regions.append((ptr, length))

    def describe(self) -> bytes:
        return self._id.encode()

    def add_peer(self, description: bytes) -> str:
        peer = description.decode()
        with self._lock:
            self._peers.add(peer)
        return peer

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        if not (len(src) == len(dst) == len(lengths)):
            raise TransferError("src, dst and lengths differ in length")
        with self._lock:
            if peer not in self._peers:
                raise TransferError(f"unknown peer {peer}")
            self.bytes_skipped += sum(lengths)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peers.discard(peer)
