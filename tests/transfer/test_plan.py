"""The region planner (`transfer/plan.py`) on its own: pure address arithmetic, checked against
hand-computed addresses and, for whole pools, by applying the planned regions with memmove."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from common.memory.kv_pool import KVPool
from tests.transfer.kv_harness import SplitPool
from transfer.base import KVArgs
from transfer.control import peer_registration
from transfer.plan import PairPlan, fuse_buffers, merge, ranks_overlapping, regions, union


def _i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _rows(src, dst, lens) -> list[tuple[int, int, int]]:
    return list(zip(src, dst, lens, strict=True))


def _args(ptrs: list[int], item: int, heads: int, rank: int = 0, tp: int = 1, **kw) -> KVArgs:
    """Hand-built args over made-up addresses (the planner never touches memory): one buffer per
    pointer, `item` bytes a page, default strides (= item)."""
    return KVArgs(kv_data_ptrs=ptrs, kv_data_lens=[item * 64] * len(ptrs), kv_item_lens=[item] * len(ptrs),
                  kv_head_num=heads, page_size=4, engine_rank=rank, tp_size=tp, **kw)


def _plan(prefill: KVArgs, decode: KVArgs) -> PairPlan:
    return PairPlan(prefill, peer_registration(decode, "decode", b""))


# ---------------------------------------------------------------- merge and fuse, byte exact


def test_merge_joins_only_exact_continuations():
    """A region merges into the previous one only when it starts exactly where that one ends, on the
    source side and on the destination side: one byte of gap or overlap on either side keeps it apart."""
    src = _i64(0, 10, 21, 31, 41, 50, 60)
    dst = _i64(100, 110, 120, 130, 141, 151, 160)
    # 10 -> 110 continues on both sides; 21 leaves a 1-byte gap in the source; 31 -> 130 continues;
    # 41 -> 141 leaves a 1-byte gap in the destination; 50 overlaps 41..51 by a byte in the source
    # (the destination continues); 60 -> 160 overlaps 151..161 by a byte in the destination
    want = [(0, 100, 20), (21, 120, 20), (41, 141, 10), (50, 151, 10), (60, 160, 10)]
    assert _rows(*merge(src, dst, np.full(7, 10, dtype=np.int64))) == want


def test_merge_sorts_by_source_first():
    src, dst, lens = _i64(20, 0, 10), _i64(220, 200, 210), _i64(10, 10, 10)
    assert _rows(*merge(src, dst, lens)) == [(0, 200, 30)]


def test_fuse_buffers_joins_exactly_adjacent_buffers_with_equal_strides():
    length = 32
    # 0 -> 32 fuse (both sides follow); 65 starts one byte late on the source; 97 follows 65 on both
    # sides; 129 follows on both sides but its destination stride differs; 300 starts a new group
    src = _i64(0, 32, 65, 97, 129, 300)
    dst = _i64(1000, 1032, 1064, 1096, 1128, 2000)
    src_stride = _i64(512, 512, 512, 512, 512, 512)
    dst_stride = _i64(512, 512, 512, 512, 256, 512)
    sb, db, ss, ds, lens = fuse_buffers(src, dst, src_stride, dst_stride, length)
    assert sb.tolist() == [0, 65, 129, 300] and db.tolist() == [1000, 1064, 1128, 2000]
    assert ss.tolist() == [512] * 4 and ds.tolist() == [512, 512, 256, 512]
    assert lens.tolist() == [64, 64, 32, 32]


def test_fuse_buffers_needs_the_destination_to_follow_too():
    sb, db, _, _, lens = fuse_buffers(_i64(0, 8, 16), _i64(100, 109, 117),
                                      _i64(64, 64, 64), _i64(64, 64, 64), 8)
    # 8 -> 109 is one byte late on the destination; 16 -> 117 follows it on both sides
    assert (sb.tolist(), db.tolist(), lens.tolist()) == ([0, 8], [100, 109], [8, 16])


def test_fused_plan_moves_the_same_bytes_as_the_unfused_regions():
    """What fusion saves is work, never bytes: fused and per-buffer regions cover the same (src, dst)
    byte pairs, for runs of pages that merge and pages that do not."""
    layers, pb = 3, 16
    stride = 2 * layers * pb
    base = 4096 + pb * np.arange(2 * layers, dtype=np.int64)
    strides = np.full(2 * layers, stride, dtype=np.int64)
    s, t = _i64(1, 2, 3, 7, 5), _i64(4, 5, 6, 1, 9)
    fused = fuse_buffers(base, base + 50000, strides, strides, pb)
    got = regions(*fused[:4], s, t, 0, 0, fused[4])
    want = regions(base, base + 50000, strides, strides, s, t, 0, 0, pb)

    def pairs(src, dst, lens) -> set[tuple[int, int]]:
        return {(a + i, b + i) for a, b, n in zip(src, dst, lens, strict=True) for i in range(n)}

    assert pairs(*got) == pairs(*want) and len(got[2]) == len(want[2]) == 3


# ---------------------------------------------------------------- PairPlan: heads, layers, state, aux


@pytest.mark.parametrize("ptp,prank,dtp,drank,src_off,dst_off,length", [
    (1, 0, 1, 0, 0, 0, 64),  # equal TP: the whole page
    (2, 1, 1, 0, 0, 32, 32),  # prefill rank 1 of 2 (heads 2, 3) lands in the upper half of a decode page
    (1, 0, 2, 1, 32, 0, 32),  # decode rank 1 of 2 reads heads 2, 3 of the prefill page
    (2, 1, 4, 3, 16, 0, 16),  # heads 2, 3 -> head 3: the second head of the prefill slice
    (4, 2, 2, 1, 0, 0, 16),  # head 2 -> heads 2, 3: the first head of the decode slice
])
def test_head_slice_offsets_for_m_to_n_tp(ptp, prank, dtp, drank, src_off, dst_off, length):
    hb, heads = 16, 4
    pa = _args([1000, 5000], hb * heads // ptp, heads // ptp, prank, ptp)
    da = _args([100000, 200000], hb * heads // dtp, heads // dtp, drank, dtp)
    plan = _plan(pa, da)
    assert (plan.kv_src_off, plan.kv_dst_off, plan.kv_len) == (src_off, dst_off, length)
    src, dst, lens = plan.kv_regions(_i64(3), _i64(5))
    pi, di = pa.kv_item_lens[0], da.kv_item_lens[0]
    assert _rows(src, dst, lens) == [(base + 3 * pi + src_off, dbase + 5 * di + dst_off, length)
                                     for base, dbase in ((1000, 100000), (5000, 200000))]


def test_ranks_overlapping_head_ranges():
    assert ranks_overlapping(0, 4, 4, 2) == [0, 1]  # a decode tp 1 rank gathers both prefill ranks
    assert ranks_overlapping(2, 4, 4, 1) == [0]  # a decode tp 2 rank reads half of the prefill rank
    assert ranks_overlapping(2, 4, 4, 4) == [2, 3]  # ends are exclusive: head 4 is not rank 3's neighbour
    assert ranks_overlapping(1, 2, 8, 4) == [0]  # a slice inside one rank's range
    assert ranks_overlapping(3, 5, 8, 4) == [1, 2]


def test_pipeline_stage_writes_its_layers_at_their_layer_ids():
    """A prefill pp stage holding layers 2, 3 writes into K2, K3, V2, V3 of a 4-layer decode rank."""
    item = 64
    # K2 K3 V2 V3
    pa = _args([10000, 20000, 30000, 40000], item, 4, kv_layer_ids=[2, 3], pp_rank=1, pp_size=2)
    decode_ptrs = [1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20, 6 << 20, 7 << 20, 8 << 20]  # K0..K3 V0..V3
    src, dst, lens = _plan(pa, _args(decode_ptrs, item, 4)).kv_regions(_i64(1), _i64(2))
    assert _rows(src, dst, lens) == [(p + item, q + 2 * item, item)
                                     for p, q in zip(pa.kv_data_ptrs,
                                                     [3 << 20, 4 << 20, 7 << 20, 8 << 20], strict=True)]


def test_hybrid_stage_pairs_kv_and_state_buffers_by_layer_id():
    """A hybrid model (layers 0, 1, 3 linear, 2 and 5 full attention) split into stages: the decode pool holds
    K/V of layers [2, 5] and conv + recurrent state of [0, 1, 3]. Stage 1 (layers 3..5) writes its K5/V5 into
    the decode's second kv layer and its layer-3 state into the decode's third conv and recurrent buffers;
    stage 0 (layers 0..2, no state of layer 3, no kv layer 5) pairs too, and a stage without kv layers has
    no kv regions at all."""
    from common.memory.state_pool import StatePool
    from transfer.plan import match_buffers

    assert match_buffers([5, 3, 3], [2, 3, 5, 3]) == [2, 1, 3] and match_buffers([4], [2, 3]) is None
    assert match_buffers([3, 3], [3]) is None  # a layer's second buffer has no counterpart
    item = 64
    decode = _args([1 << 20, 2 << 20, 3 << 20, 4 << 20], item, 4, kv_layer_ids=[2, 5],
                   state_data_ptrs=[10 << 20, 11 << 20, 12 << 20, 13 << 20, 14 << 20, 15 << 20],
                   state_data_lens=[800] * 6, state_item_lens=[100] * 6, state_dim_per_tensor=[2] * 6,
                   state_layer_ids=StatePool(1, [0, 1, 3], (2, 5), (2, 5)).buffer_layer_ids(),
                   state_type="mamba")
    assert decode.state_layer_ids == [0, 1, 3, 0, 1, 3]
    stage1 = _args([100000, 200000], item, 4, kv_layer_ids=[5], pp_rank=1, pp_size=2,
                   state_data_ptrs=[50000, 60000], state_data_lens=[800] * 2, state_item_lens=[100] * 2,
                   state_dim_per_tensor=[2] * 2, state_layer_ids=[3, 3], state_type="mamba")
    plan = _plan(stage1, decode)
    assert _rows(*plan.kv_regions(_i64(1), _i64(2))) == [(100000 + item, (2 << 20) + 2 * item, item),
                                                         (200000 + item, (4 << 20) + 2 * item, item)]
    assert _rows(*plan.state_regions(_i64(1), _i64(4))) == [(50100, (12 << 20) + 400, 100),
                                                            (60100, (15 << 20) + 400, 100)]
    stage0 = KVArgs(kv_data_ptrs=[], kv_data_lens=[], kv_item_lens=[], kv_head_num=4, kv_head_bytes=item // 4,
                    page_size=4, pp_size=2, state_data_ptrs=[70000, 80000, 90000, 95000],
                    state_data_lens=[800] * 4,
                    state_item_lens=[100] * 4, state_dim_per_tensor=[2] * 4, state_layer_ids=[0, 1, 0, 1],
                    state_type="mamba")
    plan = _plan(stage0, decode)
    assert plan.kv_regions(_i64(1, 2), _i64(3, 4)) == ([], [], [])
    assert [d for _, d, _ in _rows(*plan.state_regions(_i64(1), _i64(1)))] == [
        (10 << 20) + 100, (11 << 20) + 100, (13 << 20) + 100, (14 << 20) + 100]
    with pytest.raises(ValueError, match="kv_head_bytes"):
        KVArgs(kv_data_ptrs=[], kv_data_lens=[], kv_item_lens=[], kv_head_num=4, page_size=4)
    with pytest.raises(ValueError, match="kv_layer_ids"):
        _args([1, 2], item, 4, kv_layer_ids=[0, 1])


def _state_args(ptr: int, dim: int, rank: int, tp: int) -> KVArgs:
    unit = 20  # bytes of one leading-dimension row of a slot (5 fp32)
    return _args([0, 1 << 20], 64 // tp, 4 // tp, rank, tp, state_data_ptrs=[ptr],
                 state_data_lens=[dim * unit * 8],
                 state_item_lens=[dim * unit], state_dim_per_tensor=[dim], state_type="mamba")


@pytest.mark.parametrize("ptp,prank,dtp,drank,want", [
    (1, 0, 1, 0, [(50000 + 2 * 160, 70000 + 4 * 160, 2 * 160)]),  # consecutive slots on both sides merge
    (1, 0, 2, 1, [(50000 + 2 * 160 + 80, 70000 + 4 * 80, 80), (50000 + 3 * 160 + 80, 70000 + 5 * 80, 80)]),
    (2, 1, 1, 0, [(50000 + 2 * 80, 70000 + 4 * 160 + 80, 80), (50000 + 3 * 80, 70000 + 5 * 160 + 80, 80)]),
])
def test_state_slots_are_sliced_along_the_leading_dimension(ptp, prank, dtp, drank, want):
    """8 leading rows of 20 bytes per slot in total; a tp-2 rank holds 4 of them (80 bytes a slot)."""
    plan = _plan(_state_args(50000, 8 // ptp, prank, ptp), _state_args(70000, 8 // dtp, drank, dtp))
    assert _rows(*plan.state_regions(_i64(2, 3), _i64(4, 5))) == want


def test_state_regions_without_state_buffers_are_empty():
    plan = _plan(_args([0, 4096], 64, 4), _args([8192, 12288], 64, 4))
    assert plan.state_regions(_i64(1), _i64(2)) == ([], [], [])


def test_aux_rows_move_one_row_per_buffer():
    meta = {"aux_data_ptrs": [9000, 9500], "aux_data_lens": [64 * 8, 128 * 8], "aux_item_lens": [64, 128]}
    dmeta = {**meta, "aux_data_ptrs": [19000, 19500]}
    plan = _plan(_args([0, 4096], 64, 4, **meta), _args([8192, 12288], 64, 4, **dmeta))
    assert _rows(*plan.aux_regions(3, 1)) == [(9000 + 3 * 64, 19000 + 64, 64),
                                              (9500 + 3 * 128, 19500 + 128, 128)]


# ---------------------------------------------------------------- whole pools

def test_runs_merge_only_when_contiguous_on_both_sides():
    base, item = _i64(1000, 5000), _i64(10, 10)
    # 3..5 -> 7..9 merge; 9 -> 2 and 10 -> 4 are adjacent in the source only; 12 -> 5 and 11 -> 6 in the
    # destination only (sources 11 and 12 are adjacent but land in reverse order)
    s, t = _i64(3, 4, 5, 9, 10, 12, 11), _i64(7, 8, 9, 2, 4, 5, 6)
    src, dst, lens = regions(base, base + 100000, item, item, s, t, 0, 0, 10)
    one = [(1030, 101070, 30), (1090, 101020, 10), (1100, 101040, 10), (1110, 101060, 10), (1120, 101050, 10)]
    assert list(zip(src, dst, lens, strict=True)) == one + [(a + 4000, b + 4000, n) for a, b, n in one]


def test_page_first_strides_merge_all_layers_of_a_page_run():
    layers, pb = 3, 8
    stride = 2 * layers * pb
    base = 1000 + pb * np.arange(2 * layers, dtype=np.int64)  # K of each layer, then V, inside one page
    strides = np.full(2 * layers, stride, dtype=np.int64)
    s, t = _i64(3, 4, 5, 9), _i64(7, 8, 9, 2)
    src, dst, lens = regions(base, base + 9000, strides, strides, s, t, 0, 0, pb)
    assert list(zip(src, dst, lens, strict=True)) == [(1000 + 3 * stride, 10000 + 7 * stride, 3 * stride),
                                                      (1000 + 9 * stride, 10000 + 2 * stride, stride)]


def test_destination_layers_in_another_order_do_not_merge():
    pb, stride = 8, 32
    base, strides = _i64(0, 8, 16, 24), _i64(stride, stride, stride, stride)
    src, dst, lens = regions(base, _i64(1008, 1000, 1016, 1024), strides, strides, _i64(1), _i64(1), 0, 0, pb)
    # buffers 0 and 1 swap places in the destination: 0->1 breaks, 1->2 breaks, 2->3 merges
    assert list(zip(src, dst, lens, strict=True)) == [(32, 1040, 8), (40, 1032, 8), (48, 1048, 16)]


def test_head_slices_of_page_first_pages_stay_apart():
    layers, heads, hb = 2, 4, 4
    pb = heads * hb
    stride = 2 * layers * pb
    base = pb * np.arange(2 * layers, dtype=np.int64)
    strides = np.full(2 * layers, stride, dtype=np.int64)
    # decode rank 1 of tp 2 reads heads 2..3 of consecutive pages 1, 2 of a prefill tp 1 rank
    src, dst, lens = regions(base, base // 2 + 5000, strides, strides // 2, _i64(1, 2),
                             _i64(1, 2), 2 * hb, 0, 2 * hb)
    assert len(lens) == 2 * 2 * layers and set(lens) == {2 * hb}
    assert src[:2] == [stride + 2 * hb, stride + pb + 2 * hb] \
        and dst[:2] == [5000 + stride // 2, 5000 + stride // 2 + pb // 2]


@pytest.mark.parametrize("prefill_tp,decode_tp,fused", [(1, 1, [2 * 3 * 512]), (2, 1, [256] * 6),
                                                        (1, 2, [256] * 6)])
def test_buffers_adjacent_on_both_sides_fuse_once_per_peer(prefill_tp, decode_tp, fused):
    """Page-first pools with equal TP fuse all layers' K and V (6 buffers of 512-byte pages) into one
    buffer; head slices (2 of 4 heads, 256 bytes) do not fuse."""
    def args(tp: int, rank: int) -> KVArgs:
        return KVArgs.from_pool(KVPool(4, 2, 3, 4 // tp, 16), engine_rank=rank, tp_size=tp)

    plan = PairPlan(args(prefill_tp, 0), peer_registration(args(decode_tp, 0), "decode", b""))
    assert plan.kv[4].tolist() == fused


def test_union_of_ranges():
    # 0..50 touches 50..110, which overlaps 100..160; 200..210 stands apart; empty ranges are dropped
    assert union([100, 0, 50, 200, 300], [60, 50, 60, 10, 0]) == [(0, 160), (200, 10)]


def _fill(pool, kv: torch.Tensor, h0: int) -> None:
    heads = pool.kv_heads
    for layer in range(kv.shape[1]):
        pool.k(layer).copy_(kv[0, layer, :, h0:h0 + heads])
        pool.v(layer).copy_(kv[1, layer, :, h0:h0 + heads])


def _inside(ptr: int, n: int, args: KVArgs) -> bool:
    return any(p <= ptr and ptr + n <= p + m for p, m in union(args.kv_data_ptrs, args.kv_data_lens))


@pytest.mark.parametrize("prefill_tp,decode_tp,split", [(1, 1, None), (2, 1, None), (1, 2, None),
                                                        (1, 1, "prefill"), (2, 1, "decode")])
def test_planned_regions_move_exactly_the_pages(prefill_tp, decode_tp, split):
    """Apply every pair's planned regions with memmove and compare the decode pools with the source."""
    layers, pages, heads, page_size, dim = 3, 12, 4, 2, 4
    kv = torch.randn((2, layers, pages, heads, page_size, dim), generator=torch.Generator().manual_seed(7))

    def pool(side: str, tp: int):
        return (SplitPool if split == side else KVPool)(pages, page_size, layers, heads // tp, dim)

    prefill = [pool("prefill", prefill_tp) for _ in range(prefill_tp)]
    decode = [pool("decode", decode_tp) for _ in range(decode_tp)]
    for r, p in enumerate(prefill):
        _fill(p, kv, r * p.kv_heads)
    s, t = _i64(3, 4, 5, 9, 1, 2), _i64(7, 8, 9, 2, 10, 11)
    regions = 0
    for r, p in enumerate(prefill):
        pa = KVArgs.from_pool(p, engine_rank=r, tp_size=prefill_tp)
        for q, d in enumerate(decode):
            da = KVArgs.from_pool(d, engine_rank=q, tp_size=decode_tp)
            src, dst, lens = PairPlan(pa, peer_registration(da, "decode", b"")).kv_regions(s, t)
            regions += len(lens)
            for a, b, n in zip(src, dst, lens, strict=True):
                assert _inside(a, n, pa) and _inside(b, n, da), "a region leaves the pools"
                ctypes.memmove(b, a, n)
    if split is None and prefill_tp == decode_tp:
        assert regions == 3  # 3..5 -> 7..9, 9 -> 2, 1..2 -> 10..11, each with all layers' K and V
    for q, d in enumerate(decode):
        h0 = q * d.kv_heads
        for layer in range(layers):
            for i, buf in enumerate((d.k(layer), d.v(layer))):
                want = torch.zeros(buf.shape)
                want[t] = kv[i, layer, s, h0:h0 + d.kv_heads]
                assert torch.equal(buf, want), (layer, i)


def test_rank_overlap():
    assert ranks_overlapping(0, 4, 4, 2) == [0, 1]  # a decode tp 1 rank gathers both prefill ranks
    assert ranks_overlapping(2, 4, 4, 1) == [0]  # a decode tp 2 rank reads half of the prefill rank


