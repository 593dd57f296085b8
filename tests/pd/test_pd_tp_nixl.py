"""Prefill tp 2 -> decode tp 1 over nixl: token identity with a colocated node (several chunks), retraction
on a decode node short of KV, and a killed decode node (the prefill node fails its request and frees it)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
from node_process import http_post
from pd_harness import (
    PDPair,
    assert_restored,
    colocated_tokens,
    free_counts,
    greedy,
    make_prompts,
    start_pair,
)


@pytest.fixture(scope="module")
def pair(pd_model_dir):
    # a decode KV pool of 256 tokens and almost no decode headroom: concurrent requests must retract
    p = start_pair(pd_model_dir, "nixl", prefill_tp=2, decode_tp=1,
                   decode_settings={"max_total_tokens": 256, "num_reserved_decode_tokens": 4})
    yield p
    p.prefill.stop()
    p.decode.stop()


@pytest.fixture
def restored(pair: PDPair):
    start = pair.start_counts()
    yield
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))


def test_tp2_to_tp1_matches_colocated(pair, colocated, pd_tok, restored):
    prompts = make_prompts(pd_tok, 5, seed=11, lo=3, hi=120)
    want = colocated_tokens(colocated, prompts)
    for p, w in zip(prompts, want, strict=True):
        (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": greedy()})
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"] == w, len(p)


def test_retracted_requests_finish_with_the_same_tokens(pair, colocated, pd_tok, restored):
    prompts = make_prompts(pd_tok, 6, seed=12, lo=20, hi=40)
    want = colocated_tokens(colocated, prompts, n=40)
    before = pair.decode.stats()["num_retractions"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(40)}), prompts))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    assert pair.decode.stats()["num_retractions"] > before
    assert [db["output_ids"] for _, (_, db) in got] == want


def test_killed_decode_node_frees_the_prefill_request(pair):
    start = free_counts(pair.prefill)
    body = pair.body({"input_ids": list(range(500, 560)), "sampling_params": greedy()})
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fd = ex.submit(http_post, pair.decode.url + "/generate", body, None, 60)
        deadline = time.time() + 120  # generous: a loaded machine resolves the prefill ranks slowly
        while time.time() < deadline and not free_counts(pair.decode)["queues"].get("transfer"):
            assert not fd.done(), fd.result()
            time.sleep(0.05)
        # only from the transfer stage on has the prefill node got this room's TransferInfo
        assert free_counts(pair.decode)["queues"].get("transfer"), "the decode node never reached transfer"
        # the decode node waits for this room's KV, its TransferInfo is at the prefill node: kill it
        pair.decode.kill()
        assert fd.exception() is not None or fd.result()[0] != 200
    status, raw = http_post(pair.prefill.url + "/generate", body, timeout=60)
    assert status == 500, raw
    assert "KV transfer failed" in json.loads(raw)["error"]["message"]
    assert_restored((pair.prefill, start))
