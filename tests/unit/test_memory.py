"""The memory pools: paged allocator, req-to-token rows, KV pool layout."""

from __future__ import annotations

import pytest
import torch

from common.memory.allocator import OutOfPages, TokenToKVPoolAllocator
from common.memory.kv_pool import KVPool
from common.memory.paging import PageLayout
from common.memory.req_to_token import ReqToTokenPool


def test_allocator_pages_and_padding_page():
    a = TokenToKVPoolAllocator(num_pages=5, page_size=4)
    assert a.available_pages() == 4 and a.available_size() == 16 and a.capacity == 16
    pages = a.alloc_pages(3)
    assert 0 not in pages and len(set(pages)) == 3
    assert a.available_pages() == 1
    with pytest.raises(OutOfPages):
        a.alloc_pages(2)
    a.free_pages(pages)
    assert a.available_pages() == 4
    with pytest.raises(ValueError):
        a.free_pages([0])


def test_page_layout_round_trips():
    p = PageLayout(4)
    assert (p.pages_for(0), p.pages_for(1), p.pages_for(4), p.pages_for(5)) == (0, 1, 1, 2)
    assert (p.full_pages(3), p.full_pages(8), p.full_pages(9)) == (0, 2, 2)
    assert p.pages_needed(3, 1) == 0 and p.pages_needed(4, 1) == 1 and p.pages_needed(0, 9) == 3
    pages = torch.tensor([7, 2, 5])
    slots = p.slots_of_pages(pages, 10)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert p.slots_of_pages([3]).tolist() == [12, 13, 14, 15]
    assert p.first_slots(pages).tolist() == [28, 8, 20]
    assert p.page_of(slots).tolist() == [7] * 4 + [2] * 4 + [5] * 2
    assert p.offset_of(slots).tolist() == [0, 1, 2, 3] * 2 + [0, 1]
    assert p.pages_of_slots(slots).tolist() == [7, 2, 5]
    assert p.pages_of_slots(slots, 1, 3).tolist() == [2, 5] and p.pages_of_slots(slots, 1, 2).tolist() == [2]
    with pytest.raises(ValueError):
        PageLayout(0)


def test_alloc_extend_fills_last_page_first():
    a = TokenToKVPoolAllocator(num_pages=9, page_size=4)
    s1 = a.alloc_extend(0, 0, 6)  # 2 pages, second half full
    assert s1.numel() == 6
    assert (s1[:4] // 4).unique().numel() == 1 and (s1[4:] // 4).unique().numel() == 1
    assert s1[4] % 4 == 0 and s1[5] == s1[4] + 1
    free_before = a.available_pages()
    s2 = a.alloc_extend(6, int(s1[-1]), 2)  # fits in the open page: no new page
    assert a.available_pages() == free_before
    assert s2.tolist() == [int(s1[-1]) + 1, int(s1[-1]) + 2]
    s3 = a.alloc_extend(8, int(s2[-1]), 5)  # page aligned: two new pages
    assert a.available_pages() == free_before - 2
    assert a.pages_needed(8, 5) == 2 and a.pages_needed(6, 2) == 0 and a.pages_needed(7, 2) == 1
    all_slots = torch.cat([s1, s2, s3])
    assert all_slots.unique().numel() == 13
    a.free_slots(all_slots)
    assert a.available_pages() == 8


def test_req_to_token_pool_rows():
    p = ReqToTokenPool(size=3, max_context_len=16)
    rows = [p.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and p.alloc() is None and p.available_size() == 0
    p.write(rows[0], 2, torch.tensor([9, 10, 11]))
    assert p.slots(rows[0], 2, 5).tolist() == [9, 10, 11]
    p.free(rows[0])
    assert p.available_size() == 1
    with pytest.raises(ValueError):
        p.free(7)


def test_kv_pool_set_kv_round_trip_and_layout():
    ps, heads, dim = 4, 2, 3
    pool = KVPool(num_pages=4, page_size=ps, num_layers=2, kv_heads=heads, head_dim=dim)
    slots = torch.tensor([4, 5, 6, 9])  # page 1 offsets 0-2, page 2 offset 1
    k = torch.randn(4, heads, dim)
    v = torch.randn(4, heads, dim)
    pool.set_kv(1, slots, k, v)
    kb, vb = pool.k(1), pool.v(1)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kb[s // ps, :, s % ps, :], k[i])
        assert torch.equal(vb[s // ps, :, s % ps, :], v[i])
    assert pool.k(0).abs().sum() == 0  # other layers untouched
    # a page of a layer is one contiguous region, a head slice of it too
    page = kb[1]
    assert page.is_contiguous() and kb[1, 0].is_contiguous()
    assert pool.page_bytes == heads * ps * dim * 4 and pool.head_bytes == ps * dim * 4
    assert pool.nbytes() == 2 * 2 * 4 * pool.page_bytes
    # page-first: every layer's K and V of one page sit together, `page_stride` bytes per page
    assert pool.page_stride == 2 * 2 * pool.page_bytes
    bufs = pool.buffers()
    assert [b.data_ptr() - pool.data.data_ptr() for b in bufs] == [i * pool.page_bytes for i in range(4)]
    assert bufs[0][1].data_ptr() - bufs[0][0].data_ptr() == pool.page_stride
    assert torch.equal(bufs[3], pool.v(1))


def test_kv_pool_flat_rows_address_every_layer():
    ps, heads, dim = 4, 2, 3
    pool = KVPool(num_pages=5, page_size=ps, num_layers=3, kv_heads=heads, head_dim=dim, layer_ids=[0, 2, 5])
    slots = torch.tensor([17, 5, 6])
    k = torch.randn(3, heads, dim)
    v = torch.randn(3, heads, dim)
    rows = pool.flat_rows(slots)
    pool.set_kv_rows(5, rows, k, v)
    keys, values = pool.gather_kv(5, pool.kv_rows(rows))
    assert torch.equal(keys.view(3, heads, dim), k) and torch.equal(values.view(3, heads, dim), v)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(pool.k(5)[s // ps, :, s % ps], k[i]) \
            and torch.equal(pool.v(5)[s // ps, :, s % ps], v[i])
    assert pool.k(0).abs().sum() == 0 and pool.v(2).abs().sum() == 0
    # [B, L] slots -> [B, kv_heads, L] rows
    grid = pool.token_rows(torch.tensor([[17, 5], [6, 0]]))
    assert grid.shape == (2, heads, 2) and torch.equal(grid[0, :, 0], rows[:heads])


def _faults_writing(t: torch.Tensor) -> int:
    """Page faults this thread takes to write every byte of `t` (memset here, not on torch's threads)."""
    import ctypes
    import resource

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ctypes.memset(t.data_ptr(), 1, t.numel() * t.element_size())
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_fault_in_faults_the_pages_in_and_keeps_what_was_written():
    """A huge-page mapping's pages are faulted in (two threads), so writing them afterwards takes no faults
    (a mapping left alone takes one per page); what was written before stays."""
    from common.memory.huge_pages import fault_in, huge_zeros

    fresh = huge_zeros(64 << 20, torch.uint8)
    assert _faults_writing(fresh) >= 16  # 64 MiB: at least one fault per 2 MiB page
    t = huge_zeros(64 << 20, torch.uint8)
    t[:1000] = 7
    t[-5:] = 9
    assert fault_in(t, "test buffer", threads=2, chunk=4 << 20) is not None
    assert torch.all(t[:1000] == 7) and torch.all(t[-5:] == 9) and int(t[1000:-5].sum()) == 0
    assert _faults_writing(t) <= 2
    assert fault_in(torch.zeros(16), "small", threads=2) is None  # under a huge page: nothing to do
