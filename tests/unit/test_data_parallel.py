"""--dp-size without processes: which group a request goes to, one node's stats out of its groups',
the cores each group gets, the KV event sockets each group binds, and the checks that refuse a
`data_parallel_rank` a node cannot honour."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from common.config import ConfigError, ServerArgs
from common.kv_events import AllBlocksCleared, KVEventBatch, KVEventsConfig, offset_endpoint
from common.protocol import BadRequest
from common.scheduler.process import group_cores
from common.server.data_parallel import DPGroups, merge_stats
from common.server.http import data_parallel_ranks
from router.registry import Worker
from router.request import combine, inject, parse


def test_choose_takes_the_named_group_else_the_least_busy_in_turn():
    g = DPGroups(3)
    assert g.choose(2) == 2
    picks = []
    for _ in range(6):  # idle groups take single requests in turn
        k = g.choose(None)
        picks.append(k)
    assert picks == [0, 1, 2, 0, 1, 2]
    g.started(0)
    g.started(0)
    g.started(2)
    assert g.choose(None) == 1
    g.started(1)
    g.started(1)
    assert g.choose(None) == 2  # 0: 2 live, 1: 2 live, 2: 1 live
    g.ended(0)
    g.ended(0)
    assert g.choose(None) == 0


def test_one_group_stats_come_back_as_they_are():
    s = {"num_running_reqs": 3, "dp_rank": 0}
    assert merge_stats([s]) is s


def test_merge_adds_quantities_and_averages_ratios():
    a = {"dp_rank": 0, "num_running_reqs": 2, "kv_free_tokens": 100, "gen_throughput": 10.0,
         "cache_hit_rate": 0.5, "transfer_latency_avg_s": 0.2, "page_size": 16, "context_length": 256,
         "radix_cache": True, "speculative_algorithm": None, "disaggregation_mode": "decode",
         "num_queue_reqs": {"prealloc": 1, "waiting": 2},
         "queue_time_hist": {"buckets": [0.1, 1.0], "counts": [1, 2, 0], "sum": 0.5}}
    b = {**a, "dp_rank": 1, "num_running_reqs": 5, "kv_free_tokens": 50, "gen_throughput": 4.0,
         "cache_hit_rate": 0.25, "transfer_latency_avg_s": 0.4,
         "num_queue_reqs": {"prealloc": 0, "waiting": 7},
         "queue_time_hist": {"buckets": [0.1, 1.0], "counts": [0, 1, 3], "sum": 2.0}}
    m = merge_stats([a, b])
    assert m["dp_size"] == 2 and m["dp"] == [a, b] and "dp_rank" not in m
    assert (m["num_running_reqs"], m["kv_free_tokens"], m["gen_throughput"]) == (7, 150, 14.0)
    assert m["cache_hit_rate"] == pytest.approx(0.375) and m["transfer_latency_avg_s"] == pytest.approx(0.3)
    assert (m["page_size"], m["context_length"], m["radix_cache"]) == (16, 256, True)
    assert m["disaggregation_mode"] == "decode" and m["speculative_algorithm"] is None
    assert m["num_queue_reqs"] == {"prealloc": 1, "waiting": 9}
    assert m["queue_time_hist"] == {"buckets": [0.1, 1.0], "counts": [1, 3, 3], "sum": 2.5}


@pytest.mark.parametrize("cores, size, want", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([4, 5, 6, 7], 4, [[4], [5], [6], [7]]),
    ([0], 2, [[0], [0]]),  # fewer cores than groups: each group may run anywhere
    ([0, 1], 1, [[0, 1]]),
])
def test_group_cores_split_the_node_cores(cores, size, want):
    assert [group_cores(cores, k, size) for k in range(size)] == want


def test_each_group_publishes_kv_events_on_its_own_ports():
    cfg = KVEventsConfig.parse(json.dumps({"endpoint": "tcp://127.0.0.1:6000"}), "127.0.0.1", dp_size=3)
    # the default replay ports start past every group's endpoint
    assert [(c.endpoint, c.replay_endpoint) for c in map(cfg.for_dp_rank, range(3))] == [
        ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6003"), ("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6004"),
        ("tcp://127.0.0.1:6002", "tcp://127.0.0.1:6005")]
    one = KVEventsConfig.parse(json.dumps({"endpoint": "tcp://127.0.0.1:6000"}), "127.0.0.1")
    assert one.replay_endpoint == "tcp://127.0.0.1:6001"
    assert offset_endpoint("ipc:///tmp/ev", 2) == "ipc:///tmp/ev_dp2"
    with pytest.raises(ValueError, match="port"):
        KVEventsConfig.parse(json.dumps({"endpoint": "tcp://127.0.0.1:65535"}), "127.0.0.1", dp_size=2)


def test_batches_name_their_group_only_with_several_groups():
    enc = msgspec.msgpack.encode
    assert msgspec.msgpack.decode(enc(KVEventBatch(1.0, []))) == [1.0, [], None]  # vLLM's third field, unset
    assert msgspec.msgpack.decode(enc(KVEventBatch(1.0, [AllBlocksCleared()], 1))) == [
        1.0, [{"type": "AllBlocksCleared"}], 1]

    class TwoFields(msgspec.Struct, array_like=True):  # a consumer written before the field existed
        ts: float
        events: list

    assert msgspec.msgpack.decode(enc(KVEventBatch(1.0, [], 1)), type=TwoFields) == TwoFields(1.0, [])


def _args(dp_size: int, mode: str = "null"):
    return SimpleNamespace(dp_size=dp_size, disaggregation_mode=mode)


def test_data_parallel_rank_and_room_checks():
    assert data_parallel_ranks(_args(2), None, [None, None]) == [None, None]  # the front end chooses
    assert data_parallel_ranks(_args(2), 1, [None]) == [1]
    assert data_parallel_ranks(_args(2), None, [7, 8]) == [1, 0]  # bootstrap_room mod 2
    assert data_parallel_ranks(_args(2), 1, [9]) == [1]
    with pytest.raises(BadRequest, match="`data_parallel_rank` = 2, but this node has --dp-size 2"):
        data_parallel_ranks(_args(2), 2, [None])
    with pytest.raises(BadRequest, match="`data_parallel_rank` = 0 contradicts `bootstrap_room` 9"):
        data_parallel_ranks(_args(2), 0, [9])
    with pytest.raises(BadRequest, match="`data_parallel_rank`"):
        data_parallel_ranks(_args(1), 1, [None])


def test_dp_size_flag_checks():
    args = ServerArgs(dp_size=2)
    args.validate()
    ServerArgs(dp_size=2, disaggregation_mode="prefill").validate()
    for bad, flag in (({"dp_size": 0}, "--dp-size"), ({"dp_size": 65}, "--dp-size"),
                      ({"dp_size": 2, "dist_port": 29500}, "--dist-port")):
        with pytest.raises(ConfigError) as e:
            ServerArgs(**bad).validate()
        assert str(e.value).startswith(flag)


def test_router_rooms_fall_on_the_chosen_decode_group():
    req = parse("/generate", b'{"text": "hi", "data_parallel_rank": 1}', False)
    assert req.dp_rank == 1
    prefill = SimpleNamespace(bootstrap_host="127.0.0.1", bootstrap_port=8998)
    for _ in range(50):
        p_body, d_body, room = inject(req, prefill, "r1", [(2, 3)], 2)
        assert room % 3 == 2 and 0 <= room < 2**63
        p, d = json.loads(p_body), json.loads(d_body)
        assert "data_parallel_rank" not in p  # the prefill node has groups of its own (or none)
        assert d["data_parallel_rank"] == 2 and d["bootstrap_room"] == p["bootstrap_room"] == room
    batch = parse("/generate", b'{"text": ["a", "b", "c"]}', False)
    _, d_body, rooms = inject(batch, prefill, ["x", "y", "z"], [(1, 2), (2, 3)], 1)
    assert all(r % 2 == 1 and r % 3 == 2 for r in rooms) and len(set(rooms)) == 3
    p_body, d_body, _ = inject(batch, prefill, ["x", "y", "z"])
    assert p_body == d_body  # without --dp-aware both legs get the same bytes


def test_router_worker_counts_requests_per_group():
    from router.config import RouterConfig

    w = Worker("http://127.0.0.1:1", "decode", None, RouterConfig())
    assert w.dp_size == 1
    w.server_info = {"dp_size": 2}
    assert [w.dp_start(None), w.dp_start(None), w.dp_start(None)] == [0, 1, 0]
    assert w.dp_start(1) == 1 and w.dp_groups.live == [2, 2]
    w.dp_end(0)
    assert w.dp_start(None) == 0
    for bad in (0, -1, "2", True, 5000):  # a value out of range counts as one group
        w.server_info = {"dp_size": bad}
        assert w.dp_size == 1


def test_rooms_meeting_several_groups():
    assert combine([]) == (0, 1)
    assert combine([(1, 2), (2, 3)]) == (5, 6)
    assert combine([(1, 4), (3, 6)]) == (9, 12)  # gcd 2: compatible residues
    assert combine([(1, 4), (2, 6)]) is None  # odd and even at once
    for cong in ([(3, 4)], [(1, 4), (3, 6)], [(0, 5), (4, 7), (1, 2)]):
        r, m = combine(cong)
        assert all(r % n == a for a, n in cong) and 0 <= r < m


def test_exact_policy_pins_the_dp_group_holding_the_prefix():
    """A prefill worker with two DP groups has a view per group: the request goes to that worker and is
    pinned to the group whose cache holds its pages; with no match, to the group routed the least."""
    from common.kv_events import chain_hashes
    from router.config import RouterConfig
    from router.kv_index import WorkerView
    from router.policies import KVEventsCacheAwarePolicy, RouteKey

    class Index:
        def __init__(self, views):
            self.views = {v.key: v for v in views}

        def views_of(self, url):
            return sorted((v for v in self.views.values() if v.url == url), key=lambda v: v.dp_rank)

    a0, a1 = (WorkerView("http://a", "tcp://x:1", None, "", 4, 1000, k, 2) for k in (0, 1))
    b = WorkerView("http://b", "tcp://y:1", None, "", 4, 1000)
    ids = list(range(100, 116))
    hashes = chain_hashes(None, ids, 4)
    a1.blocks.update(hashes[:3])
    b.blocks.update(hashes[:1])
    policy = KVEventsCacheAwarePolicy(RouterConfig(), Index([a0, a1, b]), lambda: None)
    workers = [Worker("http://a", "prefill", 1, RouterConfig()),
               Worker("http://b", "prefill", 1, RouterConfig())]
    key = RouteKey(None, ids, {4: hashes})
    assert policy.select(workers, key).url == "http://a" and key.group == 1
    assert set(policy.recent) == {"http://a#dp1"}  # the pages routed there count as cached in that group
    other = list(range(500, 516))
    key = RouteKey(None, other, {4: chain_hashes(None, other, 4)})
    assert policy.select(workers[:1], key).url == "http://a" and key.group == 0
    policy.forget("http://a")
    assert not policy.recent


def test_token_slices_cut_requests_into_consecutive_ranges():
    """Two requests (5 new tokens on a 3-token prefix, then 3 new) cut into 3 ranges of the 8 tokens."""
    import torch

    from common.forward_batch import ForwardBatch, ForwardMode

    fb = ForwardBatch(ForwardMode.EXTEND, torch.arange(100, 108), torch.tensor([3, 4, 5, 6, 7, 0, 1, 2]),
                      torch.arange(40, 48), torch.tensor([7, 9]), [8, 3], [3, 0], [5, 3], None, None,
                      logits_indices=torch.tensor([4, 7]))
    parts = fb.token_slices(3)  # tokens [0, 3), [3, 5), [5, 8)
    assert [p.input_ids.tolist() for p in parts] == [[100, 101, 102], [103, 104], [105, 106, 107]]
    assert [(p.req_pool_indices.tolist(), p.extend_prefix_lens, p.extend_seq_lens,
             p.seq_lens) for p in parts] == [
                 ([7], [3], [3], [6]), ([7], [6], [2], [8]), ([9], [0], [3], [3])]
    assert [p.logits_indices.tolist() for p in parts] == [[], [1], [2]]  # each range's own rows
    assert [p.positions.tolist() for p in parts][1] == [6, 7] \
        and parts[2].out_cache_loc.tolist() == [45, 46, 47]
