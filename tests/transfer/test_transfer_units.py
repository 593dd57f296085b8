"""In-process tests of the transfer layer's pieces: region planning, metadata rows, settings,
the backend registry, and the bootstrap server's routes and registration checks."""

from __future__ import annotations

import ctypes
import json
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
from kv_harness import SplitPool, free_port

from common.memory.kv_pool import KVPool
from transfer.backends import create_engine, get_engine_class
from transfer.base import KVArgs, KVPoll, TransferSettings
from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from transfer.engine import BackendUnavailable
from transfer.manager import KVManager, _PairPlan, _ranks_overlapping, _regions, _union, peer_registration
from transfer.metadata import MetadataAllocator, MetadataBuffers


def _i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_runs_merge_only_when_contiguous_on_both_sides():
    base, item = _i64(1000, 5000), _i64(10, 10)
    # 3..5 -> 7..9 merge; 9 -> 2 and 10 -> 4 are adjacent in the source only; 12 -> 5 and 11 -> 6 in the
    # destination only (sources 11 and 12 are adjacent but land in reverse order)
    s, t = _i64(3, 4, 5, 9, 10, 12, 11), _i64(7, 8, 9, 2, 4, 5, 6)
    src, dst, lens = _regions(base, base + 100000, item, item, s, t, 0, 0, 10)
    one = [(1030, 101070, 30), (1090, 101020, 10), (1100, 101040, 10), (1110, 101060, 10), (1120, 101050, 10)]
    assert list(zip(src, dst, lens, strict=True)) == one + [(a + 4000, b + 4000, n) for a, b, n in one]


def test_page_first_strides_merge_all_layers_of_a_page_run():
    layers, pb = 3, 8
    stride = 2 * layers * pb
    base = 1000 + pb * np.arange(2 * layers, dtype=np.int64)  # K of each layer, then V, inside one page
    strides = np.full(2 * layers, stride, dtype=np.int64)
    s, t = _i64(3, 4, 5, 9), _i64(7, 8, 9, 2)
    src, dst, lens = _regions(base, base + 9000, strides, strides, s, t, 0, 0, pb)
    assert list(zip(src, dst, lens, strict=True)) == [(1000 + 3 * stride, 10000 + 7 * stride, 3 * stride),
                                                      (1000 + 9 * stride, 10000 + 2 * stride, stride)]


def test_destination_layers_in_another_order_do_not_merge():
    pb, stride = 8, 32
    base, strides = _i64(0, 8, 16, 24), _i64(stride, stride, stride, stride)
    src, dst, lens = _regions(base, _i64(1008, 1000, 1016, 1024), strides, strides, _i64(1), _i64(1), 0, 0, pb)
    # buffers 0 and 1 swap places in the destination: 0->1 breaks, 1->2 breaks, 2->3 merges
    assert list(zip(src, dst, lens, strict=True)) == [(32, 1040, 8), (40, 1032, 8), (48, 1048, 16)]


def test_head_slices_of_page_first_pages_stay_apart():
    layers, heads, hb = 2, 4, 4
    pb = heads * hb
    stride = 2 * layers * pb
    base = pb * np.arange(2 * layers, dtype=np.int64)
    strides = np.full(2 * layers, stride, dtype=np.int64)
    # decode rank 1 of tp 2 reads heads 2..3 of consecutive pages 1, 2 of a prefill tp 1 rank
    src, dst, lens = _regions(base, base // 2 + 5000, strides, strides // 2, _i64(1, 2), _i64(1, 2), 2 * hb, 0, 2 * hb)
    assert len(lens) == 2 * 2 * layers and set(lens) == {2 * hb}
    assert src[:2] == [stride + 2 * hb, stride + pb + 2 * hb] and dst[:2] == [5000 + stride // 2, 5000 + stride // 2 + pb // 2]


@pytest.mark.parametrize("prefill_tp,decode_tp,fused", [(1, 1, [2 * 3 * 512]), (2, 1, [256] * 6),
                                                        (1, 2, [256] * 6)])
def test_buffers_adjacent_on_both_sides_fuse_once_per_peer(prefill_tp, decode_tp, fused):
    """Page-first pools with equal TP fuse all layers' K and V (6 buffers of 512-byte pages) into one
    buffer; head slices (2 of 4 heads, 256 bytes) do not fuse."""
    def args(tp: int, rank: int) -> KVArgs:
        return KVArgs.from_pool(KVPool(4, 2, 3, 4 // tp, 16), engine_rank=rank, tp_size=tp)

    plan = _PairPlan(args(prefill_tp, 0), peer_registration(args(decode_tp, 0), "decode", b""))
    assert plan.kv[4].tolist() == fused


def test_union_of_ranges():
    # 0..50 touches 50..110, which overlaps 100..160; 200..210 stands apart; empty ranges are dropped
    assert _union([100, 0, 50, 200, 300], [60, 50, 60, 10, 0]) == [(0, 160), (200, 10)]


def test_kvargs_strides_default_and_validation():
    args = KVArgs(kv_data_ptrs=[0, 100], kv_data_lens=[100, 100], kv_item_lens=[20, 20], kv_head_num=2, page_size=4)
    assert args.kv_item_strides == [20, 20]
    with pytest.raises(ValueError, match="one stride per kv buffer"):
        KVArgs(kv_data_ptrs=[0, 100], kv_data_lens=[100, 100], kv_item_lens=[20, 20], kv_head_num=2, page_size=4,
               kv_item_strides=[40])
    with pytest.raises(ValueError, match="must not be smaller"):
        KVArgs(kv_data_ptrs=[0, 100], kv_data_lens=[100, 100], kv_item_lens=[20, 20], kv_head_num=2, page_size=4,
               kv_item_strides=[10, 10])


def _fill(pool, kv: torch.Tensor, h0: int) -> None:
    heads = pool.kv_heads
    for layer in range(kv.shape[1]):
        pool.k(layer).copy_(kv[0, layer, :, h0:h0 + heads])
        pool.v(layer).copy_(kv[1, layer, :, h0:h0 + heads])


def _inside(ptr: int, n: int, args: KVArgs) -> bool:
    return any(p <= ptr and ptr + n <= p + m for p, m in _union(args.kv_data_ptrs, args.kv_data_lens))


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
            src, dst, lens = _PairPlan(pa, peer_registration(da, "decode", b"")).kv_regions(s, t)
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
    assert _ranks_overlapping(0, 4, 4, 2) == [0, 1]  # a decode tp 1 rank gathers both prefill ranks
    assert _ranks_overlapping(2, 4, 4, 1) == [0]  # a decode tp 2 rank reads half of the prefill rank


def test_metadata_rows_round_trip_and_are_64_bytes():
    meta = MetadataBuffers(4, max_top_logprobs=3, hidden_size=5, spec_topk=2)
    assert all(row >= 64 and row % 64 == 0 for _, _, row in meta.buffers())
    meta.set_buf(2, first_token_id=11, cached_tokens=3, logprob_val=-0.25, logprob_idx=11, top_vals=[-0.25, -1.0],
                 top_idxs=[11, 12], room=987654321987, topk_p=[0.5, 0.5], topk_index=[11, 5],
                 hidden_state=[1, 2, 3, 4, 5])
    row = meta.get_buf(2)
    assert (row["first_token_id"], row["cached_tokens"], row["room"]) == (11, 3, 987654321987)
    assert row["top_idxs"].tolist() == [11, 12, 0] and row["hidden_state"].tolist() == [1, 2, 3, 4, 5]
    assert meta.get_room(1) == 0
    with pytest.raises(ValueError):
        meta.set_buf(0, 1, top_vals=[0.0] * 4)


def test_metadata_allocator():
    alloc = MetadataAllocator(2)
    a, b = alloc.alloc(), alloc.alloc()
    assert {a, b} == {0, 1} and alloc.alloc() is None
    alloc.free(a)
    assert alloc.alloc() == a
    with pytest.raises(ValueError):
        alloc.free(7)


def test_kvargs_from_pool_describes_pages_and_heads():
    pool = KVPool(8, 4, 2, 2, 16)
    meta = MetadataBuffers(4)
    state = torch.zeros((3, 6, 5))
    args = KVArgs.from_pool(pool, meta, [state], state_type="mamba", engine_rank=1, tp_size=2, model="m")
    assert args.num_layers == 2 and args.kv_item_lens[0] == pool.page_bytes
    assert args.kv_item_strides == [pool.page_stride] * 4
    assert _union(args.kv_data_ptrs, args.kv_data_lens) == [(pool.data.data_ptr(), pool.nbytes())]
    assert args.head_bytes == pool.head_bytes and args.total_kv_heads == 4
    assert args.state_item_lens == [6 * 5 * 4] and args.state_dim_per_tensor == [6]
    assert args.aux_room_index == meta.room_index


def test_settings_env_and_overrides(monkeypatch):
    monkeypatch.setenv("PDSERVE_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("DISAGGREGATION_TEST_FAILURE_PROB", "0.25")
    s = TransferSettings.from_env(waiting_timeout=7.0, bootstrap_timeout=None)
    assert (s.heartbeat_interval, s.failure_prob, s.waiting_timeout, s.bootstrap_timeout) == (0.5, 0.25, 7.0, 300.0)
    with pytest.raises(ValueError):
        TransferSettings.from_env(failure_prob=2.0)


def test_backend_registry(monkeypatch):
    with pytest.raises(ValueError, match="unknown transfer backend"):
        get_engine_class("carrier-pigeon")
    assert get_engine_class("fake").__name__ == "FakeEngine"
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(BackendUnavailable, match="pip install mooncake-transfer-engine"):
        create_engine("mooncake")


def _info(**kw) -> dict:
    info = {"role": "prefill", "tp_rank": 0, "tp_size": 2, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank_ip": "127.0.0.1", "rank_port": 5555, "page_size": 16, "model": "smollm", "kv_layout": "L",
            "kv_heads_total": 4, "start_layer": 0, "num_layers": 30}
    info.update(kw)
    return info


@pytest.fixture
def server():
    srv = BootstrapServer("127.0.0.1", free_port())
    srv.start()
    yield f"127.0.0.1:{srv.port}"
    srv.stop()


def test_bootstrap_routes(server):
    client = BootstrapClient()
    assert client.health(server)
    assert client.layout(server) is None  # 404 before any registration: the decode side keeps polling
    client.register(server, _info())
    assert client.rank(server, 1, 0, 0) is None
    client.register(server, _info(tp_rank=1, rank_port=5556))
    layout = client.layout(server)
    assert (layout["tp_size"], layout["page_size"], layout["model"], layout["ranks"]) == (2, 16, "smollm", 2)
    assert client.rank(server, 1, 0, 0)["rank_port"] == 5556
    with urllib.request.urlopen(f"http://{server}/route?engine_rank=0&target_dp_group=0&target_pp_rank=0") as r:
        assert json.loads(r.read())["rank_ip"] == "127.0.0.1"


@pytest.mark.parametrize("field,value", [("page_size", 32), ("model", "other-model")])
def test_bootstrap_rejects_different_page_size_or_model(server, field, value):
    client = BootstrapClient()
    client.register(server, _info())
    with pytest.raises(BootstrapError) as err:
        client.register(server, _info(tp_rank=1, **{field: value}))
    msg = str(err.value)
    assert "409" in msg and field in msg and str(value) in msg and str(_info()[field]) in msg


def test_prefill_manager_with_different_page_size_fails_to_start(server):
    BootstrapClient().register(server, _info(page_size=8, model="test-model", kv_heads_total=2, tp_size=1))
    pool = KVPool(8, 4, 2, 2, 16)
    args = KVArgs.from_pool(pool, MetadataBuffers(2), model="test-model")
    with pytest.raises(BootstrapError, match="page_size mismatch.*8.*4"):
        KVManager(args, "prefill", "fake", bootstrap_addr=server)


def test_decode_receiver_fails_on_layout_mismatch(server):
    BootstrapClient().register(server, _info(page_size=8, model="test-model", kv_heads_total=2, tp_size=1))
    pool = KVPool(8, 4, 2, 2, 16)
    mgr = KVManager(KVArgs.from_pool(pool, MetadataBuffers(2), model="test-model"), "decode", "fake")
    try:
        recv = mgr.create_receiver(server, room=77)
        recv.init([1, 2], 0)
        for _ in range(200):
            if recv.poll() == KVPoll.Failed:
                break
            time.sleep(0.02)
        assert recv.poll() == KVPoll.Failed and "page size mismatch" in recv.failure_exception().reason
    finally:
        mgr.close()


def test_decode_receiver_fails_fast_when_the_bootstrap_server_is_gone():
    # nothing listens there: a prefill node that died after the router picked it
    dead = f"127.0.0.1:{free_port()}"
    pool = KVPool(8, 4, 2, 2, 16)
    mgr = KVManager(KVArgs.from_pool(pool, MetadataBuffers(2), model="test-model"), "decode", "fake",
                    heartbeat_interval=0.2, heartbeat_max_failures=2, bootstrap_timeout=300)
    try:
        recv = mgr.create_receiver(dead, room=78)
        recv.init([1, 2], 0)
        for _ in range(500):  # bounded: well under the 300 s bootstrap timeout
            if recv.poll() == KVPoll.Failed:
                break
            time.sleep(0.02)
        assert recv.poll() == KVPoll.Failed
        assert "unreachable" in recv.failure_exception().reason and dead in recv.failure_exception().reason
    finally:
        mgr.close()
