"""DeepSeek-V3 (tiny random weights: latent attention, a dense first layer, then sigmoid-routed grouped
top-2 of 8 experts with a correction bias and a shared expert) disaggregated on 127.0.0.1: greedy tokens
equal transformers' `generate` for prompts of several chunks, and the transfer moves only the latent rows
(per token and layer `kv_lora_rank + qk_rope_head_dim` floats, once, not K and V of every head):
* nixl: a prefill node of two TP ranks (each holds the whole latent; each sends half of its bytes) to a
  decode node of one rank;
* mooncake: one prefill rank to a decode node of two TP ranks (each gets the whole latent);
* ucx: two prefill ranks to two decode ranks (each decode rank gets half of its latent from each).
Both nodes end at their starting free pages, request rows and metadata slots."""

from __future__ import annotations

import pytest
import torch

from tests.harness.backends import backend_params
from tests.harness.pd import assert_restored, greedy, make_prompts

LAYOUTS = {"nixl": (2, 1), "mooncake": (1, 2), "ucx": (2, 2)}  # backend -> (prefill tp, decode tp)
PAGE = 4  # tests.harness.pd.BASE's page size


@pytest.fixture(scope="module")
def ds_model(make_tiny_model):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("deepseek_v3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    c = hf.config
    latent_page = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4 * PAGE  # fp32 bytes
    return path, hf, latent_page


@pytest.fixture(scope="module", params=backend_params(*LAYOUTS))
def ds_pair(request, ds_model, module_launcher):
    prefill_tp, decode_tp = LAYOUTS[request.param]
    settings = {"chunked_prefill_size": 16}
    pair = module_launcher.pair(ds_model[0], request.param, prefill_tp=prefill_tp, decode_tp=decode_tp,
                                prefill_settings=settings, decode_settings=settings)
    yield pair, request.param
    pair.stop()


def _moved(pair, prompt: list[int]) -> tuple[int, int, list[int], list[int]]:
    """(bytes prefill rank 0 sent, bytes the decode node counts) for one greedy request, and its tokens."""
    before = pair.prefill.stats()["transfer_bytes"], pair.decode.stats()["transfer_bytes"]
    (s1, pb), (s2, db) = pair.generate({"input_ids": prompt, "sampling_params": greedy(8)})
    assert s1 == 200 and s2 == 200, (pb, db)
    after = pair.prefill.stats()["transfer_bytes"], pair.decode.stats()["transfer_bytes"]
    return after[0] - before[0], after[1] - before[1], pb["output_ids"], db["output_ids"]


def test_deepseek_greedy_through_pd_moves_only_the_latent(ds_pair, ds_model, pd_tok):
    (pair, backend), (_, hf, latent_page) = ds_pair, ds_model
    prefill_tp, decode_tp = LAYOUTS[backend]
    start = pair.start_counts()
    sent = {}
    for p in make_prompts(pd_tok, 3, seed=11, lo=5, hi=50) + make_prompts(pd_tok, 1, seed=3, lo=9, hi=10) \
            + make_prompts(pd_tok, 1, seed=4, lo=29, hi=30):
        s_bytes, d_bytes, first, out = _moved(pair, p)
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        assert first == want[:1]
        assert out == want, f"prompt of {len(p)} tokens"
        pages = -(-len(p) // PAGE)
        assert d_bytes == pages * latent_page, (len(p), d_bytes)  # a decode rank's pages: the latent rows
        sent[len(p)] = s_bytes
    # what prefill rank 0 really wrote, less the fixed metadata row: prompts of 9 and 29 tokens are 3 and 8
    # pages; its share is the latent rows of each page to every decode rank, over the prefill replicas
    per_page = (sent[29] - sent[9]) / 5
    assert per_page == latent_page * decode_tp / prefill_tp, (per_page, latent_page)
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
