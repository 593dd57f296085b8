"""KV events: the radix cache's block set rebuilt from its events equals the tree, hashes chain from the
root whatever splits happened, and the ZMQ publisher speaks vLLM 0.32's wire format (decoded here with
structs written against vLLM 0.32's schema, not ours, and read raw: every event a map with each key the
schema requires), replay included."""

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
from tests.harness.client import http_post
from tests.harness.nodes import free_port

PS = 4


# --- a consumer's view of the wire, as vLLM 0.32 defines it: events are maps tagged by "type"
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# the keys of each event that the schema requires (no default), the "type" tag included
REQUIRED = {"BlockStored": {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name"},
            "BlockRemoved": {"type", "block_hashes", "medium"},
            "AllBlocksCleared": {"type"}}


def raw_events(payload: bytes) -> list[dict]:
    """The events of a batch as plain msgpack: the batch an array of three, each event a map."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    for ev in batch[1]:
        assert isinstance(ev, dict), f"an event is a map, not {ev!r}"
        assert REQUIRED[ev["type"]] <= ev.keys(), ev
    return batch[1]


class Recorder:
    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def stored(self, hashes, parent, tokens) -> None:
        assert parent is None or parent in self.blocks, "a block's parent is stored before it"
        assert len(tokens) == PS * len(hashes)
        self.blocks |= set(hashes)

    def removed(self, hashes) -> None:
        assert set(hashes) <= self.blocks, "only stored blocks are removed"
        self.blocks -= set(hashes)

    def cleared(self) -> None:
        self.blocks.clear()


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
    tree.events = rec = Recorder()
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
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.enabled) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", True)
    assert KVEventsConfig.parse('{"endpoint": "tcp://[::1]:7000"}', "::1").replay_endpoint == "tcp://[::1]:7001"
    for raw, word in [("[1]", "object"), ('{"port": 1}', "unknown key 'port'"), ('{"buffer_steps": 0}', "buffer_steps"),
                      ('{"publisher": "kafka"}', "publisher"), ('{"endpoint": "udp://x:1"}', "endpoint"), ("{", "JSON")]:
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
        assert isinstance(first, BlockStored) and first.block_hashes == hashes and first.parent_block_hash is None
        assert (first.token_ids, first.block_size, first.lora_id, first.lora_name, first.medium) == (
            list(range(8)), PS, None, None, "CPU")
        assert (first.group_idx, first.kv_cache_spec_kind, first.kv_cache_spec_sliding_window) == (
            0, "full_attention", None)
        assert isinstance(got[1][2].events[0], BlockRemoved) and got[1][2].events[0].block_hashes == hashes[1:]
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
        assert (stored["group_idx"], stored["kv_cache_spec_kind"], stored["kv_cache_spec_sliding_window"]) == (
            0, "sliding_window", 64)
        assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "group_idx": 0}
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode([1.0, pub.pending, 1]))
        assert batch.events[0].kv_cache_spec_sliding_window == 64 and batch.data_parallel_rank == 1
    finally:
        pub.close()


def test_a_node_publishes_its_prefix_cache(tiny_model_dir, launcher):
    """A real node: a subscriber that joins late replays from 0 and rebuilds the node's exact block count
    (and every full prompt page's chained hash); a flush clears it."""
    port, replay = free_port(), free_port()
    node = launcher.colocated(tiny_model_dir, page_size=PS, max_total_tokens=2048, kv_events_config=json.dumps(
        {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}))
    shared = list(range(200, 220))
    prompts = [shared + [300 + i] * (3 + i) for i in range(4)]
    for p in prompts:
        code, raw = http_post(node.url + "/generate", {"input_ids": p, "sampling_params": {
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
        assert code == 200, raw
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    rec = Recorder()

    def replay_from(start: int) -> int:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        nxt = start
        while True:
            assert dealer.poll(10000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return nxt
            for ev in raw_events(payload):
                assert ev["type"] == "AllBlocksCleared" or ev["group_idx"] == 0, ev
                assert ev["type"] != "BlockStored" or (ev["block_size"], ev["kv_cache_spec_kind"]) == (
                    PS, "full_attention"), ev
            for ev in decode(payload).events:
                if isinstance(ev, BlockStored):
                    rec.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids)
                elif isinstance(ev, BlockRemoved):
                    rec.removed(ev.block_hashes)
                else:
                    rec.cleared()
            nxt = int.from_bytes(seq, "big") + 1

    try:
        nxt = replay_from(0)
        stats = node.stats()
        assert len(rec.blocks) * PS == stats["radix_cache_tokens"] > 0
        assert stats["kv_events_published"] == nxt
        for p in prompts:
            assert set(chain_hashes(None, p, PS)) <= rec.blocks
        code, raw = http_post(node.url + "/flush_cache", b"")
        assert code == 200, raw
        deadline = time.time() + 10
        while rec.blocks and time.time() < deadline:
            nxt = replay_from(nxt)
            time.sleep(0.1)
        assert not rec.blocks and node.stats()["radix_cache_tokens"] == 0
    finally:
        dealer.close()
        ctx.term()
