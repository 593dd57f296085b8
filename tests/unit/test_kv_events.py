"""KV events: the radix cache's block set rebuilt from its events equals the tree, hashes chain from the
root whatever splits happened, and the ZMQ publisher speaks vLLM 0.32's wire format (decoded with
tests/harness/kv_wire.py's structs, written against vLLM 0.32's schema, not ours, and read raw: every event
a map with each key the schema requires), replay included. A real node's events:
tests/integration/test_kv_events_node.py."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv_events import END_SEQ, KVEventPublisher, KVEventsConfig, chain_hashes
from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.radix_cache import RadixCache
from common.memory.req_to_token import ReqToTokenPool
from tests.harness.kv_wire import (
    REQUIRED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Recorder,
    raw_events,
)
from tests.harness.nodes import free_port

PS = 4


def tree_blocks(tree: RadixCache) -> set[int]:
    """Every block of the tree, its hash recomputed from the full path of tokens from the root."""
    out, stack = set(), [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + child.key
            want = chain_hashes(None, list(full), PS)[len(path) // PS:]
            assert child.hashes == want, "hashes chain from the root across splits"
            out |= set(want)
            stack.append((child, full))
    return out


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=24)),
    st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=24)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
    st.tuples(st.just("flush"), st.just(0))), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_blocks_rebuilt_from_events_equal_the_tree(seq):
    alloc = TokenToKVPoolAllocator(200, PS)
    tree = RadixCache(ReqToTokenPool(4, 256), alloc, PS)
    tree.events = rec = Recorder(PS)
    for op, arg in seq:
        if op == "insert":
            n = len(arg) - len(arg) % PS
            if n and alloc.available_pages() * PS >= n:
                slots = alloc.alloc_extend(0, 0, n)
                tree.insert(arg[:n], slots)
        elif op == "match":
            tree.match_prefix(arg)
        elif op == "evict":
            tree.evict(arg)
        else:
            assert tree.flush()
        assert rec.blocks == tree_blocks(tree)
        assert len(rec.blocks) * PS == tree.total_size()


def test_config_defaults_and_refusals():
    cfg = KVEventsConfig.parse('{"topic": "kv"}', "127.0.0.1")
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.enabled) == ("tcp://127.0.0.1:5557",
                                                                "tcp://127.0.0.1:5558", True)
    assert KVEventsConfig.parse('{"endpoint": "tcp://[::1]:7000"}', "::1").replay_endpoint == "tcp://[::1]:7001"
    for raw, word in [("[1]", "object"), ('{"port": 1}', "unknown key 'port'"),
                      ('{"buffer_steps": 0}', "buffer_steps"),
                      ('{"publisher": "kafka"}', "publisher"),
                      ('{"endpoint": "udp://x:1"}', "endpoint"), ("{", "JSON")]:
        with pytest.raises(ValueError, match=word):
            KVEventsConfig.parse(raw, "127.0.0.1")


def test_publisher_wire_and_replay_after_a_gap():
    port = free_port()
    cfg = KVEventsConfig.parse(json.dumps({"endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv",
                                           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}), "127.0.0.1")
    pub = KVEventPublisher(cfg, PS)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(cfg.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(cfg.replay_endpoint)
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    raw: list[dict] = []
    try:
        time.sleep(0.3)  # the subscription reaches the publisher
        hashes = chain_hashes(None, list(range(8)), PS)
        pub.stored(hashes, None, list(range(8)))
        pub.flush()
        pub.removed(hashes[1:])
        pub.flush()
        pub.cleared()
        pub.flush()
        got = []
        while len(got) < 3:
            assert sub.poll(5000), got
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), decode(payload)))
            raw.extend(raw_events(payload))
        assert [(t, s) for t, s, _ in got] == [(b"kv", 0), (b"kv", 1), (b"kv", 2)]
        first = got[0][2].events[0]
        assert isinstance(first, BlockStored) and first.block_hashes == hashes \
            and first.parent_block_hash is None
        assert (first.token_ids, first.block_size, first.lora_id, first.lora_name, first.medium) == (
            list(range(8)), PS, None, None, "CPU")
        assert (first.group_idx, first.kv_cache_spec_kind, first.kv_cache_spec_sliding_window) == (
            0, "full_attention", None)
        assert isinstance(got[1][2].events[0], BlockRemoved) \
            and got[1][2].events[0].block_hashes == hashes[1:]
        assert got[1][2].events[0].group_idx == 0
        assert isinstance(got[2][2].events[0], AllBlocksCleared)
        assert all(batch.data_parallel_rank is None for _, _, batch in got)
        # exactly the keys pdserve has values for: the required ones, the group and the cache's kind
        assert [sorted(ev) for ev in raw] == [
            sorted(REQUIRED["BlockStored"] | {"group_idx", "kv_cache_spec_kind"}),
            sorted(REQUIRED["BlockRemoved"] | {"group_idx"}), ["type"]]

        # a subscriber that missed everything after seq 0 asks for a replay from 1
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), decode(payload).events[0].__class__.__name__))
        assert replayed == [(1, "BlockRemoved"), (2, "AllBlocksCleared")]
        dealer.send_multipart([b"", b"short"])  # a malformed request is dropped; the publisher lives on
        pub.cleared()
        pub.flush()
        assert sub.poll(5000) and int.from_bytes(sub.recv_multipart()[1], "big") == 3
        assert pub.stats() == {"kv_events_published": 4, "kv_events_dropped": 0}
    finally:
        sub.close()
        dealer.close()
        ctx.term()
        pub.close()


def test_a_sliding_window_cache_says_so():
    cfg = KVEventsConfig.parse(json.dumps({"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}), "127.0.0.1")
    pub = KVEventPublisher(cfg, PS, dp_rank=1, sliding_window=64)
    try:
        pub.stored([7], None, [1, 2, 3, 4])
        pub.removed([7])
        payload = msgspec.msgpack.encode(pub.pending)
        stored, removed = msgspec.msgpack.decode(payload)
        assert REQUIRED["BlockStored"] <= stored.keys() and REQUIRED["BlockRemoved"] <= removed.keys()
        assert (stored["group_idx"], stored["kv_cache_spec_kind"],
                stored["kv_cache_spec_sliding_window"]) == (
                    0, "sliding_window", 64)
        assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "group_idx": 0}
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode([1.0, pub.pending, 1]))
        assert batch.events[0].kv_cache_spec_sliding_window == 64 and batch.data_parallel_rank == 1
    finally:
        pub.close()
