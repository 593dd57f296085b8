"""The transfer engines on device memory (transfer/memory.py): a page list written from one engine's VRAM
into another's, byte for byte, and a KV pool on the GPU described with its kind. Each backend whose
library is not installed on this machine is skipped with the reason."""

from __future__ import annotations

import pytest
import torch

from transfer.backends import create_engine
from transfer.engine import BackendUnavailable

PAGES, PAGE_BYTES = 64, 16384


def _engine(name: str):
    try:
        return create_engine(name, "127.0.0.1")
    except BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("backend", ["nixl", "ucx", "mooncake"])
def test_a_page_list_moves_from_vram_to_vram_byte_for_byte(backend):
    src_engine, dst_engine = _engine(backend), _engine(backend)
    gen = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randint(0, 255, (PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.zeros_like(src)
    host_row = torch.arange(64, dtype=torch.uint8).pin_memory()
    host_dst = torch.zeros(64, dtype=torch.uint8).pin_memory()
    try:
        try:
            src_engine.register(src.data_ptr(), src.numel(), "cuda:0")
            dst_engine.register(dst.data_ptr(), dst.numel(), "cuda:0")
        except BackendUnavailable as e:
            pytest.skip(str(e))
        src_engine.register(host_row.data_ptr(), 64, "host")
        dst_engine.register(host_dst.data_ptr(), 64, "host")
        peer = src_engine.add_peer(dst_engine.describe())
        pages = [(s, d) for s, d in zip(range(1, PAGES, 3), range(PAGES - 1, 0, -2), strict=False)]
        torch.cuda.synchronize()
        src_engine.write(peer, [src.data_ptr() + s * PAGE_BYTES for s, _ in pages],
                         [dst.data_ptr() + d * PAGE_BYTES for _, d in pages], [PAGE_BYTES] * len(pages),
                         "cuda:0", "cuda:0")
        src_engine.write(peer, [host_row.data_ptr()], [host_dst.data_ptr()], [64], "host", "host")
        for s, d in pages:
            assert torch.equal(dst[d], src[s]), f"page {s} -> {d}"
        written = {d for _, d in pages}
        assert all(not bool(dst[p].any()) for p in range(PAGES) if p not in written)
        assert torch.equal(host_dst, host_row)
    finally:
        src_engine.close()
        dst_engine.close()


def test_a_gpu_pool_is_described_as_device_memory_and_its_rows_as_host():
    from common.memory.kv_pool import KVPool
    from transfer.base import KVArgs
    from transfer.manager import registrations
    from transfer.metadata import MetadataBuffers

    pool = KVPool(16, 4, 2, 2, 64, device=torch.device("cuda", 0))
    meta = MetadataBuffers(8, pinned=True)
    args = KVArgs.from_pool(pool, meta, model="m")
    assert args.kv_memory == "cuda:0" and args.state_memory == "host"
    assert all(t.is_pinned() for t in (meta.tensor(n) for n in MetadataBuffers.FIELDS))
    assert {kind for *_, kind in registrations(args)} == {"cuda:0", "host"}
