"""A decode node short of KV retracts, and with `--decode-offload-size` its retracted requests resume from
the host store: the same tokens as a colocated node with a big KV budget, and the decode node prefills
nothing (no prompt + output recomputed). With the store off (0) the same run recomputes and still
matches: that is test_pd_backends' retraction test, whose nixl decode node runs with the store off.
Prefill tp 1 -> decode tp 1 over mooncake (real bytes, so the tokens can be compared); the decode KV
pool is 256 tokens with almost no decode headroom, as in test_pd_backends' nixl setup."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.harness.backends import backend_params
from tests.harness.pd import assert_restored, colocated_tokens, greedy, make_prompts

TINY_DECODE = {"max_total_tokens": 256, "num_reserved_decode_tokens": 4}


@pytest.fixture(scope="module", params=backend_params("mooncake"))
def backend(request) -> str:
    return request.param


OFFLOAD = 4096


@pytest.fixture(scope="module")
def pair(backend, pd_model_dir, module_launcher):
    p = module_launcher.pair(pd_model_dir, backend,
                             decode_settings={**TINY_DECODE, "decode_offload_size": OFFLOAD})
    yield p
    p.stop()  # now, not at the end of the session


def test_retracted_decode_requests_resume_without_prefill(pair, colocated, pd_tok):
    start = pair.start_counts()
    # each request ends holding 140-160 of the pool's 256 tokens: two that decode side by side for most of
    # their 120 steps run it out, however far a loaded host spreads the six arrivals (40 steps were not
    # enough)
    prompts = make_prompts(pd_tok, 6, seed=12, lo=20, hi=40)
    want = colocated_tokens(colocated, prompts, n=120)
    before = pair.decode.stats()
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(120)}), prompts))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    assert [db["output_ids"] for _, (_, db) in got] == want
    s = pair.decode.stats()
    retracted = s["num_retractions"] - before["num_retractions"]
    assert retracted > 0, "the decode pool was meant to run out"
    restored = s["num_retract_restored"] - before["num_retract_restored"]
    recomputed = s["num_retract_recomputed"] - before["num_retract_recomputed"]
    prefilled = s["total_prefill_tokens"] - before["total_prefill_tokens"]
    assert restored == retracted and recomputed == 0 and prefilled == 0, s
    assert s["decode_offload_capacity_tokens"] == OFFLOAD and s["decode_offload_used_tokens"] == 0
    assert pair.prefill.stats()["decode_offload_capacity_tokens"] == 0  # prefill nodes never decode
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
