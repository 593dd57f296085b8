"""--pp-size: the model's layers split into pipeline stages, each run by processes of its own.

* a prefill node with two stages of two TP ranks each (a tiny Qwen2: q/k/v biases; chunks run as
  micro-batches of 8 tokens): every (stage, TP) rank registers with the bootstrap server and sends its
  own layers' share of heads over nixl (tests/hybrid/test_hybrid_pd.py has stages over ucx, to two decode
  DP groups as here, and over mooncake) to a decode node of two DP groups speculating with n-grams, which
  answers as transformers does (the cluster of issue 18's "done means": PP prefill, DP decode,
  speculation); both nodes end with the pages and slots they started with;
* the flag's refusals name it.

Hybrid (Qwen3.5-style) and sliding-window models run stages too: tests/hybrid/test_hybrid_pd.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError, ServerArgs
from common.models.pipeline import layer_range
from tests.harness.pd import assert_restored, greedy, hf_greedy, hf_model, make_prompts

HOOKS = str(Path(__file__).resolve().parent / "node_hooks")


def test_layer_ranges_are_consecutive_and_cover_the_model():
    assert [layer_range(4, k, 3) for k in range(3)] == [(0, 2), (2, 3), (3, 4)]
    assert [layer_range(4, k, 2) for k in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError):
        layer_range(2, 0, 3)


def test_pp_size_refusals_name_the_flag():
    ServerArgs(pp_size=2, disaggregation_mode="prefill").validate()
    for bad in ({"pp_size": 0}, {"pp_size": 2, "disaggregation_mode": "decode"},
                {"pp_size": 2, "enable_overlap_schedule": True},
                {"pp_size": 2, "speculative_algorithm": "NGRAM"}):
        with pytest.raises(ConfigError) as e:
            ServerArgs(**bad).validate()
        assert str(e.value).startswith("--pp-size"), e.value


# the decode groups speculate (NGRAM): a random model never repeats itself, so the `drafts` hook
# (tests/pd/node_hooks) has the drafter propose transformers' tokens, some of them wrong
def test_prefill_stages_send_their_own_layers(make_tiny_model, module_launcher, pd_tok, tmp_path):
    model_dir = make_tiny_model("qwen2")
    prompts = make_prompts(pd_tok, 3, seed=22, lo=40, hi=110)  # 2..4 chunks of 32, micro-batches of 8
    hf = hf_model(model_dir)
    want = {f"pp-{i}": hf_greedy(hf, p, 12) for i, p in enumerate(prompts)}
    (tmp_path / "drafts").write_text(json.dumps(want))
    # eight server and scheduler processes on the test machine's two cores, where whole processes have been
    # seen not to run for 3-5.4 s (in full-suite runs only, never alone, cause not found): a heartbeat window
    # of 30 s (the fast suite's is 1.2 s) so such a pause is not a dead peer; this test is about stages, the
    # liveness rules have their own (tests/transfer/test_liveness.py, tests/integration/test_silent_peer.py)
    env = {"PDSERVE_PP_MICRO_TOKENS": "8", "PDSERVE_HEARTBEAT_MAX_FAILURES": "100", "PYTHONPATH": HOOKS,
           "PDSERVE_TEST_HOOKS_DIR": str(tmp_path)}
    pair = module_launcher.pair(model_dir, "nixl", prefill_tp=2, env=env, prefill_settings={"pp_size": 2},
                                decode_settings={"dp_size": 2, "speculative_algorithm": "NGRAM"})
    start = pair.start_counts()
    for i, p in enumerate(prompts):
        (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": greedy(12), "rid": f"pp-{i}"})
        assert ps == 200 and ds == 200, (pb, db)
        assert pb["output_ids"] == want[f"pp-{i}"][:1] and db["output_ids"] == want[f"pp-{i}"], len(p)
    groups = pair.decode.stats()["dp"]
    assert all(g["forward_ct"] > 0 for g in groups)  # consecutive rooms: both groups
    assert 0 < sum(g["spec_accepted_tokens"] for g in groups) < sum(g["spec_draft_tokens"] for g in groups)
    assert pair.prefill.stats()["pp_micro_batches"] > 0  # the chunks ran pipelined
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
