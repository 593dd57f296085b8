"""Memory kinds: where a buffer the transfer layer registers lives.

A kind is a short string: "host" (CPU memory, pageable or pinned) or "cuda:N" (memory of CUDA device N).
Every registration carries one (`TransferEngine.register(ptr, length, memory)`), and every write names
the kind of its local and of its remote regions (`write(..., src_memory, dst_memory)`), because the
engines treat the two differently: NIXL registers and describes "DRAM" and "VRAM" (with the device id)
apart, UCX maps CUDA memory with its memory type so its CUDA transports carry it, and Mooncake's CUDA
build classifies device pointers itself while its CPU build would read a device address as host memory.

What lives where on a node on a GPU: KV pages and hybrid-model state on the device, the per-request
metadata rows (`MetadataBuffers`) in pinned host memory, because the decode side's CPU reads them.
A decode rank tells the prefill rank the kind of each of its buffer families (`RegisterPeer`), and the
prefill rank checks the value (`parse_memory`) before it plans a write into them.
"""

from __future__ import annotations

HOST = "host"
_MAX_DEVICE = 1023


def parse_memory(kind: str) -> tuple[str, int]:
    """("host", 0) or ("cuda", N) for a kind string; ValueError naming the value otherwise."""
    if kind == HOST:
        return HOST, 0
    if isinstance(kind, str) and kind.startswith("cuda:"):
        index = kind[5:]
        if index.isdigit() and int(index) <= _MAX_DEVICE:
            return "cuda", int(index)
    raise ValueError(f"memory kind {kind!r} is not 'host' or 'cuda:N' (N a device index 0..{_MAX_DEVICE})")


def memory_of(tensor) -> str:
    """The kind of a tensor's storage."""
    device = tensor.device
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    raise ValueError(f"tensors on {device} cannot be transferred (host or cuda only)")


def is_device(kind: str) -> bool:
    return parse_memory(kind)[0] != HOST
