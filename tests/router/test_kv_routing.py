"""--kv-events: the router's per-worker block views follow a publisher through late joins, gaps (replayed
or not), garbage, flushes, restarts and overflow; its tokenizer gives the node's ids without torch; and
through real processes (a router, two prefill nodes publishing KV events, a decode node, fake transfer)
requests sharing a prefix go to the prefill node that cached it, a flush empties the router's view, a
garbage frame leaves the router serving, and a removed worker's view is dropped."""

from __future__ import annotations

import json
import threading
import time

import msgspec
import pytest
import zmq

from common.kv_events import END_SEQ, chain_hashes
from common.server.light_tokenizer import LightTokenizer
from router.kv_index import KVEventIndex, resolve_endpoint
from router.tokenizer import chat_messages, prompt_source, tokenize
from tests.harness.client import free_port, get_json, http, http_post, metric_total, wait_until
from tests.harness.nodes import NodeGroup, RoleNode
from tests.router.conftest import ROUTER_ARGS

_encode = msgspec.msgpack.Encoder().encode


def stored(*hashes: int) -> dict:
    """A BlockStored event as vLLM 0.32 writes it: a map tagged by "type", with every key it requires."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
            "token_ids": [0] * len(hashes), "block_size": 1, "lora_id": None,
            "medium": "CPU", "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def removed(*hashes: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "CPU", "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


def batch(*events) -> bytes:
    return _encode([time.time(), list(events), None])


class FakePublisher:
    """vLLM 0.32's wire format by hand (plain msgpack, none of our structs): batches sent live or only kept
    for replay, replay from `oldest` on."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.kept: dict[int, bytes] = {}
        self.oldest = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def info(self) -> dict:
        return {"kv_events_endpoint": f"tcp://*:{self.port}", "page_size": 1,
                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}

    def send(self, seq: int, *events, live: bool = True) -> None:
        self.send_payload(seq, batch(*events), live)

    def send_payload(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.kept[seq] = payload
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        rep = self.ctx.socket(zmq.ROUTER)
        rep.bind(f"tcp://127.0.0.1:{self.replay_port}")
        while not self.stop.is_set():
            if not rep.poll(50):
                continue
            client, _, start = rep.recv_multipart()
            for seq in sorted(self.kept):
                if seq >= max(self.oldest, int.from_bytes(start, "big")):
                    rep.send_multipart([client, b"", seq.to_bytes(8, "big"), self.kept[seq]])
            rep.send_multipart([client, b"", END_SEQ, b""])
        rep.close(0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(0)
        self.ctx.term()


def test_views_follow_gaps_garbage_restarts_and_overflow():
    pub = FakePublisher()
    index = KVEventIndex(max_blocks=8)
    url = "http://127.0.0.1:1"
    try:
        pub.send(0, stored(1, 2), live=False)  # published before the router subscribed
        [view] = index.subscribe(url, pub.info)
        assert view.endpoint == f"tcp://127.0.0.1:{pub.port}"
        wait_until(lambda: view.synced and view.blocks == {1, 2} and view.complete, what="replay from 0")
        time.sleep(0.3)  # the SUB connection is up
        pub.send(1, removed(2))
        wait_until(lambda: view.blocks == {1}, what="a live removal")
        pub.send(2, stored(3), live=False)  # lost on the way: seq 3 shows the gap, seq 2 is replayed
        pub.send(3, stored(4))
        wait_until(lambda: view.blocks == {1, 3, 4} and view.next_seq == 4, what="a replayed gap")
        assert view.counters["gaps"] == 1 and view.complete
        for frames in ([b"x"], [b"", b"short", b"p"]):
            pub.pub.send_multipart(frames)
        lacking = {k: v for k, v in stored(5).items() if k != "lora_name"}
        bad = [b"\xc1 not msgpack",
               # the older array form
               _encode([1.0, [["BlockStored", [5], None, [0], 1, None, "CPU"]], None]),
               batch(lacking),  # a required key missing
               batch({**stored(5), "block_hashes": ["5"]}),  # a value of the wrong type
               batch({**stored(5), "group_idx": "0"}),
               batch({"type": "BlockMoved", "block_hashes": [5]}),  # no such event
               batch({**stored(5), "extra_keys": msgspec.Raw(b"\x91" * 100_000 + b"\xc0")}),  # too deep
               _encode({"ts": 1.0, "events": []})]  # a batch is an array
        for seq, payload in enumerate(bad, 4):
            pub.send_payload(seq, payload)
        n = 4 + len(bad)
        pub.send(n, {**stored(5), "a_key_of_a_later_version": [1]})  # keys the schema lacks are ignored
        wait_until(lambda: 5 in view.blocks, what="events after garbage")
        assert view.counters["dropped_frames"] == 2 + len(bad) and view.next_seq == n + 1
        pub.oldest = n + 2  # the worker's buffer moved on: n + 1 cannot be replayed
        pub.send(n + 1, stored(6), live=False)
        pub.send(n + 2, stored(7), live=False)
        pub.send(n + 3, stored(8))
        wait_until(lambda: view.blocks == {7, 8} and not view.complete, what="an unreplayable gap")
        pub.send(n + 4, CLEARED)
        wait_until(lambda: not view.blocks and view.complete, what="a flush")
        pub.kept.clear()
        pub.oldest = 0
        pub.send(0, stored(9))  # the worker restarted: its sequence starts again
        wait_until(lambda: view.blocks == {9} and view.next_seq == 1, what="a restart")
        assert view.counters["restarts"] == 1
        pub.send(1, stored(*range(100, 110)))  # more than max_blocks
        wait_until(lambda: view.counters["overflows"] == 1, what="an overflow")
        assert len(view.blocks) <= 8 and not view.complete
        index.unsubscribe(url)
        assert index.views_of(url) == []
    finally:
        index.close()
        pub.close()


def test_endpoints_and_prompt_sources():
    assert resolve_endpoint("tcp://*:5557", "http://10.0.0.2:30001") == "tcp://10.0.0.2:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "http://[::1]:30001") == "tcp://[::1]:5557"
    assert resolve_endpoint("tcp://h:1", "http://x:2") == "tcp://h:1"
    assert prompt_source("/generate", {"input_ids": [[1, 2], [3]]}) == ("ids", [1, 2])
    assert prompt_source("/generate", {"text": ["a", "b"]}) == ("text", "a")
    assert prompt_source("/v1/completions", {"prompt": [[5, 6]]}) == ("ids", [5, 6])
    assert prompt_source("/v1/completions", {"prompt": ""}) is None
    assert prompt_source("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}) is None
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages([{"role": "developer", "content": parts}]) == [{"role": "system", "content": "ab"}]


def test_router_tokenizer_matches_the_node(tokenizer_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = LightTokenizer.open(tokenizer_dir)
    for text in ("Hello, world!", "  spaces\tand\nnew lines <|im_start|> é 中文", "x" * 3000):
        assert tokenize(tok, "text", text) == ref.encode(text, add_special_tokens=True)
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]):
        want = ref.encode(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
        assert tokenize(tok, "chat", chat_messages(msgs)) == want


# --------------------------------------------------------------------------------------------- real processes
PS = 16
NODE = {"page_size": PS, "max_total_tokens": 4096, "max_running_requests": 16, "num_threads": 1,
        "log_level": "info", "transfer_backend": "fake"}


@pytest.fixture
def kv_cluster(tiny_model_dir, launcher):
    prefills = [RoleNode("prefill", tiny_model_dir, name=f"prefill-{i}",
                         log_path=launcher.log_path(f"prefill-{i}"),
                         disaggregation_bootstrap_port=free_port(), kv_events_config=json.dumps(
                             {"endpoint": f"tcp://127.0.0.1:{free_port()}",
                              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}), **NODE)
                for i in range(2)]
    decode = RoleNode("decode", tiny_model_dir, log_path=launcher.log_path("decode"), **NODE)
    launcher.start(NodeGroup(prefills + [decode]))
    router = launcher.router(prefills, [decode], *ROUTER_ARGS, "--policy", "cache_aware", "--kv-events",
                             "--kv-events-pending-secs", "0")
    return router, prefills, decode


def _views(router) -> dict:
    return {w["url"]: w for w in get_json(router.url + "/workers")["workers"]
            if w["worker_type"] == "prefill"}


def _cached(url: str) -> float:
    """Prompt tokens the node served from its prefix cache so far (the decode's answer does not tell)."""
    return metric_total(url, "sglang:cached_tokens_total")


def _cached_reaches(url: str, tokens: float) -> None:
    """The prefill node counts a request's cached tokens when its own leg ends, which can come after the
    router has answered from the decode node: wait for the count, do not read it once."""
    wait_until(lambda: _cached(url) >= tokens, timeout=10, what=f"{url} to count {tokens:.0f} cached tokens")


def _gen(router, ids) -> dict:
    code, raw = http_post(router.url + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert code == 200, raw
    return json.loads(raw)["meta_info"]


def test_requests_follow_the_cached_prefix(kv_cluster):
    router, prefills, decode = kv_cluster
    wait_until(lambda: all(v.get("kv_events", {}).get("synced") for v in _views(router).values()), timeout=30,
               what="both prefill views synced")
    a, b = list(range(1000, 1000 + 6 * PS)), list(range(3000, 3000 + 6 * PS))

    def busy() -> dict[str, int]:
        return {u: v["requests"] for u, v in _views(router).items()}

    _gen(router, a + [7, 8, 9])
    first = next(u for u, n in busy().items() if n)
    wait_until(lambda: _views(router)[first]["kv_events"]["blocks"] >= 6, what="the prefix's blocks seen")
    for i in range(3):
        _gen(router, a + [50 + i] * 5)
    assert busy()[first] == 4
    _cached_reaches(first, 3 * 6 * PS)
    _gen(router, b + [1])  # nothing cached anywhere: the worker with fewer blocks
    other = next(u for u in busy() if u != first)
    assert busy()[other] == 1
    wait_until(lambda: _views(router)[other]["kv_events"]["blocks"] >= 6, what="the second prefix seen")
    _gen(router, b + [2, 3])
    assert busy()[other] == 2
    _cached_reaches(other, 6 * PS)

    # chat: the router renders the template and tokenizes like the node, so the second one is a hit
    sys_prompt = "You answer questions about the solar system in one short sentence. " * 6
    chat = {"messages": [{"role": "system", "content": sys_prompt}, {"role": "user", "content": "Mars?"}],
            "max_tokens": 2, "temperature": 0}
    before = busy()
    blocks = {u: v["kv_events"]["blocks"] for u, v in _views(router).items()}
    assert http("POST", router.url + "/v1/chat/completions", chat)[0] == 200
    chosen = next(u for u, n in busy().items() if n > before[u])
    wait_until(lambda: _views(router)[chosen]["kv_events"]["blocks"] >= blocks[chosen] + 5,
               what="the chat prefix seen")
    chat["messages"][1]["content"] = "Venus?"
    hits = _cached(chosen)
    assert http("POST", router.url + "/v1/chat/completions", chat)[0] == 200
    assert busy()[chosen] == before[chosen] + 2
    _cached_reaches(chosen, hits + 5 * PS)

    # a flush on the worker empties the router's view
    assert http_post(prefills[0].url + "/flush_cache", b"")[0] == 200
    wait_until(lambda: _views(router)[prefills[0].url]["kv_events"]["blocks"] == 0, what="the flush seen")
    assert _views(router)[prefills[0].url]["kv_events"]["complete"]
    # a removed worker's view goes with it
    wid = _views(router)[prefills[1].url]["id"]
    assert http("DELETE", router.url + f"/workers/{wid}")[0] == 200
    info = get_json(router.url + "/get_server_info")["router"]["kv_events"]
    assert list(info["workers"]) == [prefills[0].url] and info["routes"]["exact_hits"] >= 5


def test_garbage_events_do_not_stop_the_router(workers, make_router):
    pub = FakePublisher()
    try:
        p = workers["p"][0]
        p.config(info=pub.info)
        r = make_router([p], workers["d"][:1], "--kv-events")
        wait_until(lambda: _views(r)[p.url].get("kv_events", {}).get("synced"), what="subscribed")
        time.sleep(0.3)
        for frames in ([b"only one"], [b"", b"12345678", b"\x92\xcb garbage"], [b"", b"\xff" * 9, b""]):
            pub.pub.send_multipart(frames)
        # a frame with a plausible but false sequence number looks like a gap the worker cannot replay: the
        # view is cleared, and the next real batch (its number now goes back) replays it from 0
        hashes = chain_hashes(None, list(range(40)), 1)
        pub.send(0, stored(*hashes[:30]))
        pub.send(1, stored(*hashes[30:]))
        wait_until(lambda: _views(r)[p.url]["kv_events"]["blocks"] == 40, what="valid events after garbage")
        assert _views(r)[p.url]["kv_events"]["dropped_frames"] >= 2
        assert r.post("/generate", {"input_ids": list(range(40))})[0] == 200  # text-less routing by ids works
        assert r.post("/generate", {"input_ids": [2**63 + 5]})[0] == 200  # unhashable ids: routed by the tree
        code, _, metrics = http("GET", r.url + "/metrics")
        assert f'pdserve_router_kv_events_total{{kind="dropped_frames",worker="{p.url}"}}' in metrics.decode()
    finally:
        pub.close()


def test_exact_policy_choices():
    """Longest cached prefix in tokens wins; imbalanced loads and no match go by load; a worker without
    events sends the choice to the approximate tree; pages just routed count until their TTL."""
    import asyncio

    from router.config import RouterConfig
    from router.kv_index import WorkerView
    from router.policies import KVEventsCacheAwarePolicy, RouteKey
    from router.registry import Worker
    from router.request import parse

    class Index:
        views: dict = {}

        def views_of(self, url):
            return [self.views[url]] if url in self.views else []

    cfg = RouterConfig(kv_events=True, kv_events_pending_secs=0)
    index = Index()
    policy = KVEventsCacheAwarePolicy(cfg, index, lambda: None)
    ws = [Worker(f"http://127.0.0.1:{9000 + i}", "prefill", None, cfg) for i in range(3)]
    ids = list(range(64))
    hashes = chain_hashes(None, ids, 4)
    for w in ws:
        index.views[w.url] = WorkerView(w.url, "tcp://x:1", None, "", 4, 1000)
    index.views[ws[0].url].blocks = set(hashes[:3])
    index.views[ws[1].url].blocks = set(hashes[:5])  # the longest prefix
    index.views[ws[2].url].blocks = {hashes[7]}  # not a prefix
    req = parse("/generate", json.dumps({"input_ids": ids}).encode(), True)
    key = asyncio.run(policy.prepare(req))
    assert key.ids == ids and set(key.hashes) == {4}
    assert policy.select(ws, key) is ws[1]
    ws[1].active = 100  # imbalanced beyond --balance-abs/rel-threshold: the least loaded
    assert policy.select(ws, key) is ws[0] and policy.counts["load"] == 1
    ws[1].active = 0
    other = RouteKey("zzz", [999] * 8, {4: chain_hashes(None, [999] * 8, 4)})
    ws[0].active = 1
    assert policy.select(ws, other) is ws[2]  # no match: least active, then fewest blocks
    del index.views[ws[2].url]
    assert policy.select(ws, key) in ws and policy.counts["approximate"] == 1 and policy.trees
    policy.pending_secs = 30
    index.views[ws[2].url] = WorkerView(ws[2].url, "tcp://x:1", None, "", 4, 1000)
    fresh = RouteKey(None, list(range(500, 540)), {4: chain_hashes(None, list(range(500, 540)), 4)})
    ws[0].active = 0
    first = policy.select(ws, fresh)
    # routed pages count before events confirm
    assert all(policy.select(ws, fresh) is first for _ in range(3))
