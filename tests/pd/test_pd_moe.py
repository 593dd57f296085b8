"""Mixture-of-experts models (tiny random-weight Qwen3-MoE: a dense first layer, then top-2 of 4 experts;
Mixtral: top-2 of 4 on every layer) disaggregated on 127.0.0.1: greedy tokens equal transformers'
`generate` for prompts of several chunks:
* nixl, Qwen3-MoE: a prefill node of two TP ranks with expert parallelism (each rank holds two whole
  experts) to a decode node of one rank;
* mooncake, Mixtral: one prefill rank to a decode node of two TP ranks, each holding half of every expert;
* ucx, Qwen3-MoE: a prefill node of two ranks, each half of every expert, to a decode node of two EP ranks
  with EPLB rebalancing every 3 forwards (spare copies moved between the ranks while requests decode);
* nixl, Mixtral: a prefill node of two EP ranks to a decode node of one rank;
* ucx, Mixtral: one prefill rank to a decode node of two EP ranks.
Both nodes end at their starting free pages, request rows and metadata slots, and report the expert
loads they counted."""

from __future__ import annotations

import pytest
import torch

from tests.harness.backends import backend_params
from tests.harness.pd import assert_restored, greedy, make_prompts

EP2 = {"ep_size": 2}
EPLB = {"ep_size": 2, "enable_eplb": True, "eplb_rebalance_num_iterations": 3}
# layout (its backend first) -> (model, prefill tp, decode tp, prefill settings, decode settings)
LAYOUTS = {"nixl": ("qwen3_moe", 2, 1, EP2, {}), "mooncake": ("mixtral", 1, 2, {}, {}),
           "ucx": ("qwen3_moe", 2, 2, {}, EPLB), "nixl-mixtral": ("mixtral", 2, 1, EP2, {}),
           "ucx-mixtral": ("mixtral", 1, 2, {}, EP2)}
MODELS = {"qwen3_moe": {"mlp_only_layers": [0]}, "mixtral": {}}


def _layout_params() -> list:
    return [pytest.param(name, marks=p.marks, id=name)
            for name in LAYOUTS for p in backend_params(name.split("-")[0])]


@pytest.fixture(scope="module", params=_layout_params())
def moe_pair(request, make_tiny_model, module_launcher):
    """(the pair, its layout, transformers' model of what it serves)."""
    from transformers import AutoModelForCausalLM

    arch, prefill_tp, decode_tp, prefill, decode = LAYOUTS[request.param]
    path = make_tiny_model(arch, **MODELS[arch])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    settings = {"chunked_prefill_size": 16}
    pair = module_launcher.pair(path, request.param.split("-")[0], prefill_tp=prefill_tp, decode_tp=decode_tp,
                                prefill_settings={**settings, **prefill},
                                decode_settings={**settings, **decode})
    yield pair, request.param, hf
    pair.stop()


def test_moe_greedy_through_pd(moe_pair, pd_tok):
    pair, layout, hf = moe_pair
    start = pair.start_counts()
    for p in make_prompts(pd_tok, 3, seed=11, lo=5, hi=50):
        (s1, pb), (s2, db) = pair.generate({"input_ids": p, "sampling_params": greedy(8)})
        assert s1 == 200 and s2 == 200, (pb, db)
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        assert pb["output_ids"] == want[:1]
        assert db["output_ids"] == want, f"prompt of {len(p)} tokens"
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    _, _, _, prefill, decode = LAYOUTS[layout]
    for node, extra in ((pair.prefill, prefill), (pair.decode, decode)):
        s = node.stats()
        assert s["moe_ep_size"] == extra.get("ep_size", 1)
        assert all(sum(v) > 0 for v in s["moe_expert_load"].values()), s["moe_expert_load"]
        assert (s["moe_eplb_rebalances"] > 0) == bool(extra.get("enable_eplb")), s["moe_eplb_rebalances"]


def test_moe_concurrent_requests_through_pd(moe_pair, pd_tok):
    """Six requests at once: the decode batches them (with EPLB on ucx, rebalancing between batch steps)."""
    import concurrent.futures

    pair, _, hf = moe_pair
    start = pair.start_counts()
    prompts = make_prompts(pd_tok, 6, seed=12, lo=5, hi=40)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        answers = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(12)}),
                              prompts))
    for p, ((s1, pb), (s2, db)) in zip(prompts, answers, strict=True):
        assert s1 == 200 and s2 == 200, (pb, db)
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        assert db["output_ids"] == want, f"prompt of {len(p)} tokens"
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
