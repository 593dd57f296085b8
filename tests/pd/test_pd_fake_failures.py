"""The `fake` backend (no bytes move): the lifecycle completes and queues drain; injected transfer failures
(DISAGGREGATION_TEST_FAILURE_PROB=0.3) end requests with clear errors on both nodes, and both nodes are
back at their starting free pages, request slots and metadata slots."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from tests.harness.client import http
from tests.harness.nodes import PDPair
from tests.harness.pd import assert_restored, free_counts, greedy, make_prompts


@pytest.fixture(scope="module")
def pair(pd_model_dir, module_launcher):
    return module_launcher.pair(pd_model_dir, "fake", env={"DISAGGREGATION_TEST_FAILURE_PROB": "0.3"},
                                prefill_settings={"disaggregation_bootstrap_timeout": 5})


def test_lifecycle_with_injected_failures(pair: PDPair, pd_tok):
    start = pair.start_counts()
    prompts = make_prompts(pd_tok, 24, seed=5, lo=3, hi=100)
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(4)}), prompts))
    ok = failed = 0
    for (ps, pb), (ds, db) in got:
        if ps == 200:
            assert ds == 200, db  # a room the sender finished is a room the receiver finished
            assert len(db["output_ids"]) == 4 and db["meta_info"]["finish_reason"]["type"] == "length"
            ok += 1
        else:
            assert ps == 500 and ds == 500, (pb, db)
            for body in (pb, db):
                assert "injected failure (DISAGGREGATION_TEST_FAILURE_PROB=0.3)" in body["error"]["message"]
            failed += 1
    # 24 rooms at p=0.3: both outcomes happen (all-or-nothing has probability < 2e-4)
    assert ok > 0 and failed > 0
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert pair.decode.stats()["transfer_failures"] >= failed


def test_bootstrap_timeout_frees_the_prefill_request(pair: PDPair):
    start = free_counts(pair.prefill)
    # no decode leg ever comes; the prefill node gives the room up after its bootstrap timeout (5 s here)
    body = pair.body({"input_ids": list(range(400, 420)), "sampling_params": greedy()})
    status, headers, raw = http("POST", pair.prefill.url + "/generate", body, timeout=60)
    assert status == 500, raw
    assert "no TransferInfo from the decode side" in json.loads(raw)["error"]["message"]
    # the cause is named for a router, which then does not hold it against this node's circuit breaker
    assert headers["x-pd-error-type"] == "kv_transfer"
    assert_restored((pair.prefill, start))
