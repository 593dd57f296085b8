"""bfloat16 against float32 (triton backend; bfloat16 with CUDA graphs, float32 eager) on tiny random-weight
Llama, Qwen3 and the Qwen3.5-style hybrid.

What is checked: with bfloat16 fed float32's own tokens (teacher forcing), each step's logits stay within
`LOGIT_TOLERANCE` of float32's, relative to that step's logit spread; rounding can then flip only a token
whose two best logits were that close. Free-running greedy agreement over 256 tokens is measured, not
checked: a random-weight model's logits are nearly tied, so bfloat16 rounding parts the two runs early on
some prompts (the CPU engine's bfloat16 on tiny Qwen3 parts at token 2). Both go to
`$PDSERVE_GPU_RESULTS/bf16_agreement.json`."""

from __future__ import annotations

import torch

from tests.gpu.conftest import Engine, prompts, write_result

STEPS = 256
FORCED_STEPS = 64
LOGIT_TOLERANCE = 0.05  # max |bf16 - fp32| over (max - min) of the step's float32 logits


def _worst_relative_error(f32_logits: list[torch.Tensor], bf16_logits: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(f32_logits, bf16_logits, strict=True):
        spread = (a.max(-1).values - a.min(-1).values).clamp(min=1e-6)
        worst = max(worst, float(((b - a).abs().max(-1).values / spread).max()))
    return worst


def test_bfloat16_agrees_with_float32(make_model):
    report = {}
    total = agree = 0
    for arch in ("llama", "qwen3", "qwen3_5"):
        ps = prompts(seed=1)
        f32_engine = Engine(make_model(arch), "triton", "float32")
        bf16_engine = Engine(make_model(arch), "triton", "bfloat16", graphs=True)
        f32 = f32_engine.generate(ps, STEPS)
        bf16 = bf16_engine.generate(ps, STEPS)
        same = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(f32, bf16, strict=True)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), STEPS)
                 for x, y in zip(f32, bf16, strict=True)]
        f32_logits, bf16_logits = [], []
        f32_engine.generate(ps, FORCED_STEPS, logits_out=f32_logits)
        forced_tokens = bf16_engine.generate(ps, FORCED_STEPS, forced=f32, logits_out=bf16_logits)
        forced_same = sum(a == b for x, y in zip(f32, forced_tokens, strict=True)
                          for a, b in zip(x[:FORCED_STEPS], y, strict=True))
        report[arch] = {"fraction": sum(same) / (STEPS * len(ps)), "first_difference": first,
                        "forced_fraction": forced_same / (FORCED_STEPS * len(ps)),
                        "forced_worst_relative_logit_error": _worst_relative_error(f32_logits, bf16_logits),
                        "graph_replays": bf16_engine.replays}
        total += STEPS * len(ps)
        agree += sum(same)
    report["all"] = {"fraction": agree / total, "tokens": total}
    write_result("bf16_agreement", report)  # before the checks: the figures are the result either way
    for arch in ("llama", "qwen3", "qwen3_5"):
        r = report[arch]
        assert r["graph_replays"] > 0, f"{arch}: the bfloat16 decode never replayed a CUDA graph"
        assert r["forced_worst_relative_logit_error"] <= LOGIT_TOLERANCE, (arch, r)
