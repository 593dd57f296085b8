"""Prefill tp 1 -> decode tp 2 over ucx: token identity with a colocated node, then a killed prefill node
(the decode node notices through the heartbeat, fails its request and frees everything)."""

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
    p = start_pair(pd_model_dir, "ucx", prefill_tp=1, decode_tp=2)
    yield p
    p.prefill.stop()
    p.decode.stop()


def test_tp1_to_tp2_matches_colocated(pair: PDPair, colocated, pd_tok):
    start = pair.start_counts()
    prompts = make_prompts(pd_tok, 6, seed=21, lo=3, hi=120)
    want = colocated_tokens(colocated, prompts)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy()}), prompts))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    assert [db["output_ids"] for _, (_, db) in got] == want
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))


def test_killed_prefill_node_frees_the_decode_request(pair: PDPair):
    start = free_counts(pair.decode)
    body = pair.body({"input_ids": list(range(600, 650)), "sampling_params": greedy()})
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fd = ex.submit(http_post, pair.decode.url + "/generate", body, None, 60)
        deadline = time.time() + 120  # generous: a loaded machine resolves the prefill ranks slowly
        while time.time() < deadline and not free_counts(pair.decode)["queues"].get("transfer"):
            assert not fd.done(), fd.result()
            time.sleep(0.05)
        # only from the transfer stage on has the prefill node got this room's TransferInfo
        assert free_counts(pair.decode)["queues"].get("transfer"), "the decode node never reached transfer"
        pair.prefill.kill()
        status, raw = fd.result()
    assert status == 500, raw
    msg = json.loads(raw)["error"]["message"]
    # the rank that noticed names the dead peer; the other rank reports the consensus
    assert "KV transfer failed" in msg and ("dead" in msg or "another TP rank" in msg), msg
    assert_restored((pair.decode, start))
