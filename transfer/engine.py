"""The byte mover under every real backend.

A backend module (mooncake, nixl, ucx) only has to implement this small class: register local
memory, describe itself to peers, and write batches of (local address -> peer address, length)
regions into a peer's registered memory. Everything above it (control plane, chunking, page
coalescing, TP head slicing, metadata, heartbeats, timeouts) is shared code in `transfer/`, so the
protocol logic is written once and every backend gets the same failure handling.

Writes are one-sided pushes from the prefill side into the decode side's registered buffers.
`write` blocks until the batch is complete (callers run it on a worker thread) and raises
`TransferError` with a reason on any failure.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence


class TransferError(RuntimeError):
    """A batch write failed; the message says why (peer unreachable, engine error code, ...)."""


class BackendUnavailable(RuntimeError):
    """The backend's library is not installed; the message names the package to install."""


class TransferEngine(abc.ABC):
    """One engine instance per process (per TP rank)."""

    name: str = "abstract"

    def __init__(self, hostname: str = "127.0.0.1", device_name: str | None = None) -> None:
        self.hostname = hostname
        self.device_name = device_name

    @abc.abstractmethod
    def register(self, ptr: int, length: int) -> None:
        """Register [ptr, ptr+length) of host memory for remote writes (and as a write source).

        Must be called for every buffer before `describe()` is sent to peers."""

    @abc.abstractmethod
    def describe(self) -> bytes:
        """Opaque description a peer needs to write into this engine's registered memory
        (address/session id and any remote keys). Sent once per peer over the control plane."""

    @abc.abstractmethod
    def add_peer(self, description: bytes) -> str:
        """Prepare to write into the peer described by `description`; returns a peer handle.
        Idempotent for the same description."""

    @abc.abstractmethod
    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy each local region src[i] of lengths[i] bytes to the peer's dst[i]; blocking."""

    def remove_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Forget a peer (it died or was deregistered)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""
