"""EAGLE / MTP across PD: the prefill node runs the draft layers over the prompt and sends the first
draft and the draft layers' hidden state with the first token (`MetadataBuffers` `topk_index`, `topk_p`,
`hidden_states`); the draft layer's KV moves with the other layers' pages. The decode node (mooncake:
TP 2 from a TP-1 prefill; nixl: TP 1 from a TP-2 prefill) starts its first verify from them, answers as
transformers does, and drafts and accepts exactly what one
colocated engine does on the same prompts (a checkpoint whose drafts depend on
the draft layer's KV, so a missing or wrong KV page or hidden state would show)."""

from __future__ import annotations

import pytest

from common.protocol import SamplingParams
from tests.harness.pd import BASE, assert_restored, greedy, hf_greedy, hf_model, make_prompts
from tests.unit.test_engine_correctness import Engine
from tests.unit.test_mtp import bigram_checkpoint

SPEC = {"speculative_algorithm": "MTP", "speculative_num_steps": 3}


def colocated_spec_stats(model_dir: str, prompts: list[list[int]], n: int) -> dict:
    eng = Engine(model_dir, **BASE, **SPEC)
    for i, p in enumerate(prompts):  # one at a time, as the pair gets them
        eng.submit(f"r{i}", p, sampling=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
        eng.run()
    return eng.sched.get_stats()


# mooncake prefill tp 1 -> decode tp 2, nixl prefill tp 2 -> decode tp 1 (ucx moves a hybrid model's draft
# layer in tests/hybrid/test_hybrid_pd.py)
@pytest.mark.parametrize("backend,tp", [pytest.param(b, tp, marks=pytest.mark.backend(b), id=b)
                                        for b, tp in (("mooncake", {"decode_tp": 2}),
                                                      ("nixl", {"prefill_tp": 2}))])
def test_decode_speculates_from_the_prefill_nodes_draft(make_tiny_model, launcher,
                                                        pd_tok, tmp_path, backend, tp):
    model_dir = bigram_checkpoint(make_tiny_model("llama", mtp_num_hidden_layers=1), tmp_path / "m",
                                  draft_attention=3.0)
    pair = launcher.pair(model_dir, backend, prefill_settings=SPEC, decode_settings=SPEC, **tp)
    start = pair.start_counts()
    hf = hf_model(model_dir)
    prompts = make_prompts(pd_tok, 3, seed=31, lo=3, hi=70)
    for p in prompts:
        (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": greedy(13)})
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"] == hf_greedy(hf, p, 13), len(p)
    d = pair.decode.stats()
    want = colocated_spec_stats(model_dir, prompts, 13)
    assert 0 < d["spec_accepted_tokens"] < d["spec_draft_tokens"], d
    # the same verify steps, drafts and accepted drafts as one engine that ran the prompt itself: the
    # decode's first step already verified a chain from the prefill node's draft (without it, that step
    # would be a plain one and every count after it would differ)
    for key in ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens"):
        assert d[key] == want[key], (key, d[key], want[key])
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
