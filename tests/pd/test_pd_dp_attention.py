"""DP attention on real nodes (`--dp-size 2 --enable-dp-attention --ep-size 2`, tiny random-weight Qwen3-MoE:
each DP group's attention over its own requests, each sparse block over both groups' tokens with two whole
experts on each group's rank, the groups in lockstep): greedy tokens equal transformers' `generate` for
requests sent one at a time (one group runs, the other idles through the sparse blocks) and six at once
(both groups run):
* a colocated node;
* mooncake: a prefill node of one rank (EP 1) to a decode node with DP attention;
* nixl: a prefill node with DP attention to a decode node of one rank.
Every node ends at its starting free pages, request rows and metadata slots."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch

from tests.harness.backends import backend_params
from tests.harness.client import http_post
from tests.harness.pd import assert_restored, free_counts, greedy, make_prompts, wait_restored

DPA = {"dp_size": 2, "enable_dp_attention": True, "ep_size": 2, "chunked_prefill_size": 16}
LAYOUTS = {"mooncake": ({}, DPA), "nixl": (DPA, {})}  # backend -> (prefill settings, decode settings)


@pytest.fixture(scope="module")
def hf_and_path(make_tiny_model):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("qwen3_moe", mlp_only_layers=[0])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    return hf, path


def _want(hf, p: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()


def _one_then_six(send, hf, tok) -> None:
    """Two requests one after the other, then six at once; each answer against transformers."""
    for p in make_prompts(tok, 2, seed=21, lo=5, hi=40):
        assert send(p, 8) == _want(hf, p, 8), f"prompt of {len(p)} tokens"
    prompts = make_prompts(tok, 6, seed=22, lo=5, hi=40)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda p: send(p, 12), prompts))
    for p, ids in zip(prompts, got, strict=True):
        assert ids == _want(hf, p, 12), f"prompt of {len(p)} tokens"


def test_dp_attention_colocated(hf_and_path, module_launcher, pd_tok):
    hf, path = hf_and_path
    node = module_launcher.colocated(path, **DPA)
    start = wait_restored(node, free_counts(node))

    def send(p, n):
        status, body = http_post(node.url + "/generate", {"input_ids": p, "sampling_params": greedy(n)})
        assert status == 200, body
        return json.loads(body)["output_ids"]

    _one_then_six(send, hf, pd_tok)
    assert_restored((node, start))
    stats = node.stats()
    assert stats["moe_ep_size"] == 2 and all(sum(v) > 0 for v in stats["moe_expert_load"].values())
    node.stop()


@pytest.mark.parametrize("backend", backend_params(*LAYOUTS))
def test_dp_attention_through_pd(hf_and_path, module_launcher, pd_tok, backend):
    hf, path = hf_and_path
    prefill, decode = LAYOUTS[backend]
    pair = module_launcher.pair(path, backend, prefill_settings={"chunked_prefill_size": 16, **prefill},
                                decode_settings={"chunked_prefill_size": 16, **decode})
    try:
        start = pair.start_counts()

        def send(p, n):
            (s1, pb), (s2, db) = pair.generate({"input_ids": p, "sampling_params": greedy(n)})
            assert s1 == 200 and s2 == 200, (pb, db)
            return db["output_ids"]

        _one_then_six(send, hf, pd_tok)
        assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
        for node, extra in ((pair.prefill, prefill), (pair.decode, decode)):
            assert node.stats()["moe_ep_size"] == extra.get("ep_size", 1)
    finally:
        pair.stop()
