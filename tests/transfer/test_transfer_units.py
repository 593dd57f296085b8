"""In-process tests of the transfer layer's pieces: KVArgs, metadata rows, settings, the backend
registry, and the bootstrap server's routes and registration checks (the region planner has its
own file, test_plan.py)."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from common.hybrid import HybridSupport
from common.memory.kv_pool import KVPool
from tests.transfer.kv_harness import free_port
from transfer.backends import create_engine, get_engine_class
from transfer.base import KVArgs, KVPoll, TransferSettings
from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from transfer.engine import BackendUnavailable
from transfer.metadata import MetadataAllocator, MetadataBuffers
from transfer.plan import union
from transfer.receiver import DecodeKVManager
from transfer.sender import PrefillKVManager


def test_kvargs_strides_default_and_validation():
    args = KVArgs(kv_data_ptrs=[0, 100], kv_data_lens=[100, 100], kv_item_lens=[20, 20],
                  kv_head_num=2, page_size=4)
    assert args.kv_item_strides == [20, 20]
    with pytest.raises(ValueError, match="one stride per kv buffer"):
        KVArgs(kv_data_ptrs=[0, 100], kv_data_lens=[100, 100], kv_item_lens=[20, 20],
               kv_head_num=2, page_size=4, kv_item_strides=[40])
    with pytest.raises(ValueError, match="must not be smaller"):
        KVArgs(kv_data_ptrs=[0, 100], kv_data_lens=[100, 100], kv_item_lens=[20, 20],
               kv_head_num=2, page_size=4, kv_item_strides=[10, 10])


def test_metadata_rows_round_trip_and_are_64_bytes():
    meta = MetadataBuffers(4, max_top_logprobs=3, hidden_size=5, spec_topk=2)
    assert all(row >= 64 and row % 64 == 0 for _, _, row in meta.buffers())
    meta.set_buf(2, first_token_id=11, cached_tokens=3, logprob_val=-0.25,
                 logprob_idx=11, top_vals=[-0.25, -1.0],
                 top_idxs=[11, 12], room=987654321987, topk_p=[0.5, 0.5], topk_index=[11, 5],
                 hidden_state=[1, 2, 3, 4, 5])
    row = meta.get_buf(2)
    assert (row["first_token_id"], row["cached_tokens"], row["room"]) == (11, 3, 987654321987)
    assert row["top_idxs"].tolist() == [11, 12, 0] and row["hidden_state"].tolist() == [1, 2, 3, 4, 5]
    assert meta.get_room(1) == 0
    with pytest.raises(ValueError):
        meta.set_buf(0, 1, top_vals=[0.0] * 4)


def test_a_received_first_draft_is_checked():
    meta = MetadataBuffers(2, hidden_size=4)
    meta.set_buf(0, 7, topk_index=[9], topk_p=[1.0], hidden_state=[0.5, 1, 2, 3])
    assert meta.check_row(0, 100, 10, draft=True) is None
    meta.set_buf(0, 7, topk_index=[100], topk_p=[1.0], hidden_state=[0.5, 1, 2, 3])
    assert "topk_index[0] = 100" in meta.check_row(0, 100, 10, draft=True)
    assert meta.check_row(0, 100, 10) is None  # a node without draft layers never reads it
    meta.set_buf(0, 7, topk_index=[9], topk_p=[1.0], hidden_state=[0.5, float("nan"), 2, 3])
    assert "hidden_states" in meta.check_row(0, 100, 10, draft=True)
    meta.set_buf(1, 7, topk_index=[12345], hidden_state=[float("inf")] * 4)  # topk_p 0: no draft sent
    assert meta.check_row(1, 100, 10, draft=True) is None


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
    assert union(args.kv_data_ptrs, args.kv_data_lens) == [(pool.data.data_ptr(), pool.nbytes())]
    assert args.head_bytes == pool.head_bytes and args.total_kv_heads == 4
    assert args.state_item_lens == [6 * 5 * 4] and args.state_dim_per_tensor == [6]
    assert args.aux_room_index == meta.room_index


class _Window:
    def kv_window(self) -> int:
        return 8


def test_kvargs_from_runner_takes_the_state_the_model_reports():
    """The transfer layer builds its args from neutral facts of `common.hybrid.HybridSupport`."""
    pool, meta = KVPool(8, 4, 2, 2, 16), MetadataBuffers(4)
    state = torch.zeros((3, 6, 5))
    mamba = SimpleNamespace(state_buffers=lambda: [state], state_type="mamba", state_leading_dims=lambda: [6],
                            state_layer_ids=lambda: [7])
    for hybrid, want in [
        (mamba,
         KVArgs.from_pool(pool, meta, [state], state_type="mamba", state_dim_per_tensor=[6], engine_rank=1,
                          tp_size=2, model="m", state_layer_ids=[7])),
        (HybridSupport(object()), KVArgs.from_pool(pool, meta, engine_rank=1, tp_size=2, model="m")),
        (HybridSupport(_Window()),
         KVArgs.from_pool(pool, meta, state_type="swa", engine_rank=1, tp_size=2, model="m")),
    ]:
        runner = SimpleNamespace(kv_pool=pool, hybrid=hybrid, model_config=SimpleNamespace(name="m"))
        assert KVArgs.from_runner(runner, meta, engine_rank=1, tp_size=2) == want


def test_settings_env_and_overrides(monkeypatch):
    monkeypatch.setenv("PDSERVE_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("DISAGGREGATION_TEST_FAILURE_PROB", "0.25")
    s = TransferSettings.from_env(waiting_timeout=7.0, bootstrap_timeout=None)
    assert (s.heartbeat_interval, s.failure_prob, s.waiting_timeout, s.bootstrap_timeout) \
        == (0.5, 0.25, 7.0, 300.0)
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
    info = {"role": "prefill", "tp_rank": 0, "tp_size": 2, "dp_rank": 0, "dp_size": 1,
            "pp_rank": 0, "pp_size": 1,
            "rank_ip": "127.0.0.1", "rank_port": 5555, "page_size": 16, "model": "smollm", "kv_layout": "L",
            "kv_heads_total": 4}
    info.update(kw)
    return info


@pytest.fixture
def server():
    srv = BootstrapServer("127.0.0.1", free_port())
    srv.start()
    yield f"127.0.0.1:{srv.port}"
    srv.stop()


# The server answers from a thread of this test process, and this xdist worker has run other files' transfer
# engines: ci90 saw one answer take over 2 s (the client's default timeout) while a mooncake engine of an
# earlier test was being torn down in the process (its removeSegmentDesc lines, one every ~0.5 s, were the
# test's captured output). These tests check what the server answers, not how fast, so they wait longer.
CLIENT_TIMEOUT = 30.0


def test_bootstrap_routes(server):
    client = BootstrapClient(timeout=CLIENT_TIMEOUT)
    assert client.health(server)
    assert client.layout(server) is None  # 404 before any registration: the decode side keeps polling
    client.register(server, _info())
    assert client.rank(server, 1, 0, 0) is None
    client.register(server, _info(tp_rank=1, rank_port=5556))
    layout = client.layout(server)
    assert (layout["tp_size"], layout["page_size"], layout["model"], layout["ranks"]) == (2, 16, "smollm", 2)
    assert client.rank(server, 1, 0, 0)["rank_port"] == 5556
    with urllib.request.urlopen(
            f"http://{server}/route?engine_rank=0&target_dp_group=0&target_pp_rank=0") as r:
        assert json.loads(r.read())["rank_ip"] == "127.0.0.1"


@pytest.mark.parametrize("field,value", [("page_size", 32), ("model", "other-model")])
def test_bootstrap_rejects_different_page_size_or_model(server, field, value):
    client = BootstrapClient(timeout=CLIENT_TIMEOUT)
    client.register(server, _info())
    with pytest.raises(BootstrapError) as err:
        client.register(server, _info(tp_rank=1, **{field: value}))
    msg = str(err.value)
    assert "409" in msg and field in msg and str(value) in msg and str(_info()[field]) in msg


def test_prefill_manager_with_different_page_size_fails_to_start(server):
    BootstrapClient(timeout=CLIENT_TIMEOUT).register(server, _info(page_size=8, model="test-model",
                                                                   kv_heads_total=2, tp_size=1))
    pool = KVPool(8, 4, 2, 2, 16)
    args = KVArgs.from_pool(pool, MetadataBuffers(2), model="test-model")
    with pytest.raises(BootstrapError, match="page_size mismatch.*8.*4"):
        PrefillKVManager(args, "fake", bootstrap_addr=server)


def test_decode_receiver_fails_on_layout_mismatch(server):
    BootstrapClient(timeout=CLIENT_TIMEOUT).register(server, _info(page_size=8, model="test-model",
                                                                   kv_heads_total=2, tp_size=1))
    pool = KVPool(8, 4, 2, 2, 16)
    mgr = DecodeKVManager(KVArgs.from_pool(pool, MetadataBuffers(2), model="test-model"), "fake")
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
    mgr = DecodeKVManager(KVArgs.from_pool(pool, MetadataBuffers(2), model="test-model"), "fake",
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


def test_node_flags_win_over_the_environment(monkeypatch):
    from common.config import ServerArgs
    from disaggregation.kv import node_settings

    monkeypatch.setenv("PDSERVE_TRANSFER_DEVICES", "mlx5_9")
    monkeypatch.setenv("PDSERVE_WAITING_TIMEOUT", "40")
    s = node_settings(ServerArgs(disaggregation_ib_device="mlx5_0,mlx5_1",
                                 disaggregation_bootstrap_timeout=12.0))
    assert (s.device_name, s.bootstrap_timeout, s.waiting_timeout) == ("mlx5_0,mlx5_1", 12.0, 40.0)
    assert node_settings(ServerArgs()).device_name == "mlx5_9"  # no flag: the environment's


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_engine_threads_leave_a_dp_groups_core_share(monkeypatch):
    """A DP group's process is pinned to its share of the node's cores (one core of two here); the threads a
    transfer engine starts (UCX's async and progress threads) get every core of the node back, so they never
    spin on the one core the chunk writers holding their locks need (transfer/engine.py: spread_over_node)."""
    import threading

    from transfer.backends import create_engine
    from transfer.engine import BackendUnavailable, thread_ids

    node = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("PDSERVE_NODE_CORES", ",".join(map(str, node)))
    os.sched_setaffinity(0, node[:1])  # this thread: the group's share; threads it starts inherit it
    try:
        before = thread_ids()
        try:
            engine = create_engine("ucx", "127.0.0.1")
        except BackendUnavailable as e:
            pytest.skip(str(e))
        new = thread_ids() - before
        assert new, "the ucx engine starts threads of its own"
        assert all(os.sched_getaffinity(t) == set(node) for t in new)
        engine.close()
        # a thread the scheduler starts itself keeps the group's share
        seen = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert seen == [set(node[:1])]
    finally:
        os.sched_setaffinity(0, node)
