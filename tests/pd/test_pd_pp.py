"""--pp-size: the model's layers split into pipeline stages, each run by processes of its own.

* a colocated node with three stages (layers 0-1, 2, 3 of the tiny llama) answers as a one-stage node:
  greedy tokens over prompts of several chunks, and the logprobs the last stage computes;
* a prefill node with two stages of two TP ranks each: every (stage, TP) rank registers with the
  bootstrap server and sends its own layers' share of heads to the decode node, which answers as
  colocated; both nodes end with the pages and slots they started with;
* the flag's refusals name it.
"""

from __future__ import annotations

import json

import pytest

from common.config import ConfigError, ServerArgs
from common.models.llama import layer_range
from tests.harness.client import http_post
from tests.harness.pd import BASE, FAST_ENV, assert_restored, colocated_tokens, greedy, make_prompts


def test_layer_ranges_are_consecutive_and_cover_the_model():
    assert [layer_range(4, k, 3) for k in range(3)] == [(0, 2), (2, 3), (3, 4)]
    assert [layer_range(4, k, 2) for k in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError):
        layer_range(2, 0, 3)


def test_pp_size_refusals_name_the_flag():
    ServerArgs(pp_size=2, disaggregation_mode="prefill").validate()
    for bad in ({"pp_size": 0}, {"pp_size": 2, "disaggregation_mode": "decode"},
                {"pp_size": 2, "enable_overlap_schedule": True}, {"pp_size": 2, "speculative_algorithm": "NGRAM"}):
        with pytest.raises(ConfigError) as e:
            ServerArgs(**bad).validate()
        assert str(e.value).startswith("--pp-size"), e.value


def test_three_stages_answer_as_one(pd_model_dir, module_launcher, colocated, pd_tok):
    node = module_launcher.colocated(pd_model_dir, env=FAST_ENV, pp_size=3, **BASE)
    prompts = make_prompts(pd_tok, 6, seed=21, lo=3, hi=110)  # up to four 32-token chunks
    assert colocated_tokens(node, prompts) == colocated_tokens(colocated, prompts)
    body = {"input_ids": prompts[0], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "sampling_params": greedy(4)}
    got, want = (json.loads(http_post(n.url + "/generate", body)[1])["meta_info"] for n in (node, colocated))
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [t for _, t, *_ in got[key]] == [t for _, t, *_ in want[key]]
        assert [v for v, *_ in got[key] if v is not None] == pytest.approx(
            [v for v, *_ in want[key] if v is not None], abs=1e-4)
    stats = node.stats()
    assert stats["kv_total_tokens"] == BASE["max_total_tokens"]


def test_prefill_stages_send_their_own_layers(pd_model_dir, module_launcher, colocated, pd_tok):
    pair = module_launcher.pair(pd_model_dir, "mooncake", prefill_tp=2, prefill_settings={"pp_size": 2})
    start = pair.start_counts()
    prompts = make_prompts(pd_tok, 6, seed=22, lo=3, hi=110)
    want = colocated_tokens(colocated, prompts)
    for p, w in zip(prompts, want, strict=True):
        (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": greedy()})
        assert ps == 200 and ds == 200, (pb, db)
        assert pb["output_ids"] == w[:1] and db["output_ids"] == w
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
