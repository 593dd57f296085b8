"""KV events from a real node (`--kv-events-config`): a subscriber that joins late replays from 0 and
rebuilds the node's exact block set; the publisher's wire format itself is checked in
tests/unit/test_kv_events.py."""

from __future__ import annotations

import json
import time

import msgspec
import zmq

from common.kv_events import END_SEQ, chain_hashes
from tests.harness.client import http_post
from tests.harness.kv_wire import BlockRemoved, BlockStored, KVEventBatch, Recorder, raw_events
from tests.harness.nodes import free_port

PS = 4


def test_a_node_publishes_its_prefix_cache(tiny_model_dir, launcher):
    """A real node: a subscriber that joins late replays from 0 and rebuilds the node's exact block count
    (and every full prompt page's chained hash); a flush clears it."""
    port, replay = free_port(), free_port()
    config = {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    node = launcher.colocated(tiny_model_dir, page_size=PS, max_total_tokens=2048,
                              kv_events_config=json.dumps(config))
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
    rec = Recorder(PS)

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
