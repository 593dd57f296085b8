"""The `fake` backend: an engine that moves no bytes.

Everything above the engine still runs for real (bootstrap, control plane, TransferInfo, chunk
planning, heartbeats, timeouts, failure injection, the state machine), so schedulers can be tested
end to end without a transfer library. `moves_bytes = False` tells the receiver not to check the
metadata row's room (nothing was written into it).

It keeps the memory-kind contract as a real engine must: every region is registered with its kind,
`describe()` carries this engine's registered regions with their kinds, and a write is refused
(`TransferError`) unless each local region lies in memory registered here as `src_memory` and each
remote one in memory the peer described as `dst_memory`. So the fake-backend suite checks, on a CPU
and on a GPU node alike, that the planner sends every region with the kind it lives in.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

import msgspec
import numpy as np

from transfer.engine import TransferEngine, TransferError
from transfer.memory import HOST, parse_memory


class _Description(msgspec.Struct, array_like=True):
    engine_id: str
    regions: list[tuple[int, int, str]]  # (base, length, memory kind)


class _Regions:
    """Registered [base, base + length) spans of each memory kind, for containment checks."""

    def __init__(self, regions: list[tuple[int, int, str]]) -> None:
        self.by_kind: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for kind in {k for _, _, k in regions}:
            spans = sorted((b, b + n) for b, n, k in regions if k == kind)
            self.by_kind[kind] = (np.array([s for s, _ in spans], dtype=np.int64),
                                  np.array([e for _, e in spans], dtype=np.int64))

    def outside(self, kind: str, addrs: Sequence[int], lengths: Sequence[int]) -> int | None:
        """The index of the first region not inside memory of `kind` (None: all are inside)."""
        if not len(addrs):
            return None
        a = np.asarray(addrs, dtype=np.int64)
        n = np.asarray(lengths, dtype=np.int64)
        starts, ends = self.by_kind.get(kind, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        i = np.searchsorted(starts, a, side="right") - 1
        ok = (i >= 0) & (n >= 0)
        ok[ok] &= a[ok] + n[ok] <= ends[i[ok]]
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else None


class FakeEngine(TransferEngine):
    name = "fake"
    moves_bytes = False

    def __init__(self, hostname: str = "127.0.0.1", device_name: str | None = None) -> None:
        super().__init__(hostname, device_name)
        self._id = f"fake:{hostname}:{uuid.uuid4().hex}"
        self._registered: list[tuple[int, int, str]] = []
        self._local = _Regions([])
        self._peers: dict[str, _Regions] = {}
        self._lock = threading.Lock()
        self.bytes_skipped = 0

    def register(self, ptr: int, length: int, memory: str = HOST) -> None:
        parse_memory(memory)
        with self._lock:
            self._registered.append((ptr, length, memory))
            self._local = _Regions(self._registered)

    def describe(self) -> bytes:
        with self._lock:
            return msgspec.msgpack.encode(_Description(self._id, list(self._registered)))

    def add_peer(self, description: bytes) -> str:
        try:
            desc = msgspec.msgpack.decode(description, type=_Description)
        except msgspec.DecodeError as e:
            raise TransferError(f"fake engine description is malformed: {e}") from e
        with self._lock:
            self._peers[desc.engine_id] = _Regions(desc.regions)
        return desc.engine_id

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = HOST, dst_memory: str = HOST) -> None:
        if not (len(src) == len(dst) == len(lengths)):
            raise TransferError("src, dst and lengths differ in length")
        with self._lock:
            remote = self._peers.get(peer)
            if remote is None:
                raise TransferError(f"unknown peer {peer}")
            local = self._local
        for side, regions, kind, addrs in (("local", local, src_memory, src),
                                           ("remote", remote, dst_memory, dst)):
            i = regions.outside(kind, addrs, lengths)
            if i is not None:
                raise TransferError(f"{side} region {addrs[i]:#x}+{lengths[i]} is not in memory registered "
                                    f"as {kind!r}")
        with self._lock:
            self.bytes_skipped += sum(lengths)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)
