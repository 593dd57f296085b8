"""The single-plane KV pool (`KVPool(shared_kv=True)`, multi-head latent attention): one row per token and
layer that both K and V reads hit, stored once; and what it shows the transfer layer (two halves of each
layer's page, fused back into whole pages by the planner)."""

from __future__ import annotations

import pytest
import torch

from common.memory.kv_pool import KVPool
from transfer.base import KVArgs


def test_single_plane_layout_and_rows():
    pool = KVPool(6, 4, 3, 1, 10, shared_kv=True)
    assert pool.data.shape == (6, 1, 3, 1, 4, 10)
    assert pool.v_offset == 0 and pool.page_rows == 3 * 4
    assert pool.page_stride == 3 * 4 * 10 * 4 and pool.nbytes() == 6 * pool.page_stride
    assert pool.k(1).data_ptr() == pool.v(1).data_ptr()
    slots = torch.tensor([4, 5, 13, 22])
    rows = pool.flat_rows(slots)
    k = torch.randn(4, 1, 10)
    pool.set_kv_rows(2, rows, k, k)
    keys, values = pool.gather_kv(2, pool.kv_rows(rows))
    assert torch.equal(keys, k.view(4, 10)) and keys.data_ptr() == values.data_ptr()
    assert torch.equal(pool.k(2)[pool.page_of(slots), 0, pool.offset_of(slots)], k.view(4, 10))
    assert pool.k(1).abs().sum() == 0 and pool.k(0).abs().sum() == 0  # other layers untouched


def test_single_plane_holds_one_head():
    with pytest.raises(ValueError, match="one KV head"):
        KVPool(4, 4, 2, 2, 8, shared_kv=True)


def test_transfer_sees_half_pages_that_cover_the_pool_once():
    pool = KVPool(5, 4, 3, 1, 10, shared_kv=True)
    bufs = pool.buffers()
    assert len(bufs) == 6  # "K" and "V" of each layer
    half = 4 * 10 * 4 // 2
    args = KVArgs.from_pool(pool)
    assert args.kv_item_lens == [half] * 6 and args.kv_head_bytes == half
    assert args.kv_item_strides == [pool.page_stride] * 6
    base = pool.data.data_ptr()
    for layer in range(3):  # K half then V half: the layer's page, back to back
        assert args.kv_data_ptrs[layer] == base + layer * 2 * half
        assert args.kv_data_ptrs[3 + layer] == base + layer * 2 * half + half
    covered = set()
    for p, n, st in zip(args.kv_data_ptrs, args.kv_item_lens, args.kv_item_strides, strict=True):
        for page in range(5):
            covered.update(range(p + page * st - base, p + page * st - base + n))
    assert covered == set(range(pool.nbytes()))  # every byte once, nothing outside
    assert all(p + n <= base + pool.nbytes() for p, n in zip(args.kv_data_ptrs, args.kv_data_lens,
                                                             strict=True))


def test_native_decode_leaves_heads_beyond_its_kernel_to_torch():
    """DeepSeek-V3's shape (128 query heads on one KV head of 512 + 64 features) is past the native decode
    kernel's head size and group; that backend decodes it with the torch path, over a single-plane pool."""
    from common.forward_batch import ForwardBatch, ForwardMode
    from common.layers.attention import TorchAttentionBackend

    heads, d = 128, 576
    native = TorchAttentionBackend(heads, 1, d, scaling=0.1, native=True)
    assert native.native is None
    pool = KVPool(4, 4, 1, 1, d, shared_kv=True)
    r2t = torch.zeros(2, 8, dtype=torch.int64)
    r2t[0, :3] = torch.tensor([4, 5, 6])
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(2, 1, d, generator=gen)
    pool.set_kv(0, torch.tensor([4, 5]), old, old)
    q, row = torch.randn(1, heads * d, generator=gen), torch.randn(1, d, generator=gen)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(1, dtype=torch.int64),
                      positions=torch.tensor([2]), out_cache_loc=torch.tensor([6]),
                      req_pool_indices=torch.tensor([0]), seq_lens=[3], extend_prefix_lens=[2],
                      extend_seq_lens=[1], kv_pool=pool, req_to_token=r2t)
    native.init_forward_metadata(fb)
    out = native.forward(q, row, row, 0, fb)
    keys = torch.cat([old.view(2, d), row])
    want = ((q.view(heads, d) @ keys.T) * 0.1).softmax(-1) @ keys
    assert torch.allclose(out.view(heads, d), want, atol=1e-5)
