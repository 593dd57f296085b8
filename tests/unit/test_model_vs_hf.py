"""Teacher-forced logits of our model == Hugging Face transformers' (eager, fp32) on the same weights:
one extend, chunked extends on top of a cached prefix, and decode steps (one request and a batch of
requests of different lengths), over scrambled (non-contiguous) KV pages."""

from __future__ import annotations

import pytest
import torch

from common.models.loader import load_model
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)

TOL = 1e-4
# oneDNN's packed matmul (the serving default, common/layers/linear.py) sums in another order than
# F.linear; on SmolLM2, whose logits reach ~34, that moves them by up to ~1.5e-4 (4.5e-6 relative)
PACKED_RTOL = 1e-5

ARCH_CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-rope-llama3-tied": ("llama", {
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                            "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "llama-mha-bias": ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    # mixture of experts (common/layers/moe.py): a dense first layer, renormalised top-2 of 4 experts
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [0]}),
    # every other layer sparse, top-3 weights left as the softmax gave them
    "qwen3_moe-step2-unnormed": ("qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": False,
                                               "num_experts_per_tok": 3}),
    "mixtral": ("mixtral", {}),
    # Qwen3.5-MoE (hybrid: Gated DeltaNet state per request): top-2 of 4 experts plus the gated shared expert
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    # DeepSeek-V3 (latent attention over a single-plane cache of 32 + 8 per token, sigmoid-routed grouped
    # top-2 of 8 experts steered by a random correction bias, a shared expert, a dense first layer)
    "deepseek_v3": ("deepseek_v3", {}),
    # queries without the low-rank bottleneck, rope features not interleaved, YaRN (its mscale in the
    # softmax scale)
    "deepseek_v3-q-proj-yarn": ("deepseek_v3", {
        "q_lora_rank": None, "rope_interleave": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.707},
    }),
}


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def prompt(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def harness_for(model, cfg, **kw) -> Harness:
    """Pools for `model`: a hybrid one (recurrent state) gets a state slot per request as well."""
    if getattr(model, "is_hybrid", False):
        from tests.hybrid.hybrid_harness import HybridHarness

        return HybridHarness(model, cfg, **kw)
    return Harness.for_model(cfg, **kw)


def check_model(model_dir: str, page_size: int, n: int = 45, attention_backend: str = "native") -> None:
    model, cfg = load_model(model_dir, attention_backend=attention_backend)
    ids = prompt(n, vocab=cfg.vocab_size)
    ref = hf_logits(model_dir, ids)

    # 1) the whole prompt in one extend
    h = harness_for(model, cfg, page_size=page_size)
    row = h.new_req()
    out = model(h.extend_batch([(row, ids)], all_logits=True))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < TOL

    # default logits rows: the last token of each request
    h2 = harness_for(model, cfg, page_size=page_size, scramble_seed=1)
    r = h2.new_req()
    last = model(h2.extend_batch([(r, ids[:20])]))
    assert last.shape == (1, cfg.vocab_size)
    assert (last[0] - ref[19]).abs().max().item() < TOL

    # 2) chunked: extends on top of the cached prefix (chunk boundaries inside and at pages)
    h = harness_for(model, cfg, page_size=page_size, scramble_seed=2)
    row = h.new_req()
    start = 0
    for size in (13, 3, page_size, 9):
        chunk = ids[start:start + size]
        out = model(h.extend_batch([(row, chunk)], all_logits=True))
        assert (out - ref[start:start + size]).abs().max().item() < TOL, f"chunk at {start}"
        start += size

    # 3) decode steps for one request after a prefill of 30 tokens
    h = harness_for(model, cfg, page_size=page_size, scramble_seed=3)
    row = h.new_req()
    model(h.extend_batch([(row, ids[:30])]))
    for p in range(30, n):
        out = model(h.decode_batch([(row, ids[p])]))
        assert (out[0] - ref[p]).abs().max().item() < TOL, f"decode at {p}"

    # 4) a batch: two requests extended together (different prefixes), then decoded together
    h = harness_for(model, cfg, page_size=page_size, scramble_seed=4)
    a, b = h.new_req(), h.new_req()
    model(h.extend_batch([(a, ids[:10])]))
    out = model(h.extend_batch([(a, ids[10:25]), (b, ids[:7])], all_logits=True))
    assert (out[:15] - ref[10:25]).abs().max().item() < TOL
    assert (out[15:] - ref[:7]).abs().max().item() < TOL
    pa, pb = 25, 7
    for _ in range(6):
        out = model(h.decode_batch([(a, ids[pa]), (b, ids[pb])]))
        assert (out[0] - ref[pa]).abs().max().item() < TOL
        assert (out[1] - ref[pb]).abs().max().item() < TOL
        pa, pb = pa + 1, pb + 1


@pytest.mark.parametrize("backend", ["native", "torch_native"])
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_tiny_matches_hf(make_tiny_model, case, backend):
    """Both CPU attention backends: the C kernels, and torch_native (the GPU engine's reference path)."""
    arch, overrides = ARCH_CASES[case]
    check_model(make_tiny_model(arch, **overrides), page_size=4, attention_backend=backend)


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_llama_page_sizes(tiny_model_dir, page_size):
    check_model(tiny_model_dir, page_size=page_size, n=40)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_smollm2_matches_hf(smollm2_dir, monkeypatch, packed):
    """Plain F.linear: within 1e-4 of HF. Packed oneDNN weights: within 1e-5 of the largest logit."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "1" if packed else "0")
    model, cfg = load_model(smollm2_dir)
    assert (model.lm_head_packed is not None) == packed
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ids = ids + prompt(8, seed=5)
    ref = hf_logits(smollm2_dir, ids)
    tol = PACKED_RTOL * ref.abs().max().item() if packed else TOL
    n = len(ids)
    h = Harness.for_model(cfg, page_size=16)
    row = h.new_req()
    out = model(h.extend_batch([(row, ids[:n - 6])], all_logits=True))
    assert (out - ref[:n - 6]).abs().max().item() < tol
    assert torch.equal(out.argmax(-1), ref[:n - 6].argmax(-1))
    for p in range(n - 6, n):
        out = model(h.decode_batch([(row, ids[p])]))
        assert (out[0] - ref[p]).abs().max().item() < tol, f"decode at {p}"


def test_the_last_layer_runs_only_the_rows_whose_logits_are_wanted(make_tiny_model, monkeypatch):
    """An extend's last layer takes its MLP over the rows whose logits are wanted only
    (`LlamaForCausalLM.rows_going_on`): the same logits, bit for bit, as with every row going on, for
    a batch of requests on a cached prefix and for every row's logits (nothing pruned); and the next
    decode step, which reads the K/V that layer stored, agrees too."""
    from common.models.llama import LlamaForCausalLM

    model_dir = make_tiny_model("llama", gguf_blocks=True)
    model, cfg = load_model(model_dir)
    ids = prompt(40, vocab=cfg.vocab_size)
    seen = []
    real = LlamaForCausalLM.rows_going_on

    def spy(self, fb):
        seen.append(real(self, fb))
        return seen[-1]

    outs = []
    for prune in (True, False):
        monkeypatch.setattr(LlamaForCausalLM, "rows_going_on", spy if prune else lambda self, fb: None)
        h = Harness.for_model(cfg, page_size=4)
        a, b = h.new_req(), h.new_req()
        runs = [model(h.extend_batch([(a, ids[:7])])),
                model(h.extend_batch([(a, ids[7:20]), (b, ids[20:31])])),
                model(h.extend_batch([(b, ids[31:36])], all_logits=True)),
                model(h.decode_batch([(a, ids[36]), (b, ids[37])]))]
        outs.append(runs)
    assert [None if r is None else r.tolist() for r in seen] == [[6], [12, 23], None]
    for pruned, full in zip(*outs, strict=True):
        assert torch.equal(pruned.view(torch.int32), full.view(torch.int32))
