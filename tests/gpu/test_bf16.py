"""bfloat16 against float32 over 256 greedy tokens (triton backend; bfloat16 with CUDA graphs, float32
eager): the agreement fraction, per model and in all, goes to `$PDSERVE_GPU_RESULTS/bf16_agreement.json`.
bfloat16 rounding parts the two greedy runs sooner or later, so only the first 8 tokens of each prompt
must agree."""

from __future__ import annotations

from tests.gpu.conftest import Engine, prompts, write_result

STEPS = 256


def test_bfloat16_agrees_with_float32(make_model):
    report = {}
    total = agree = 0
    for arch in ("llama", "qwen3", "qwen3_5"):
        ps = prompts(seed=1)
        f32 = Engine(make_model(arch), "triton", "float32").generate(ps, STEPS)
        bf16 = Engine(make_model(arch), "triton", "bfloat16", graphs=True).generate(ps, STEPS)
        same = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(f32, bf16, strict=True)]
        # where each prompt's greedy runs first part
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), STEPS)
                 for x, y in zip(f32, bf16, strict=True)]
        report[arch] = {"fraction": sum(same) / (STEPS * len(ps)), "first_difference": first}
        total += STEPS * len(ps)
        agree += sum(same)
    report["all"] = {"fraction": agree / total, "tokens": total}
    write_result("bf16_agreement", report)  # before the check: the figures are the result either way
    early = {arch: r["first_difference"] for arch, r in report.items()
             if arch != "all" and min(r["first_difference"]) < 8}
    assert not early, f"bfloat16 parts from float32 within 8 tokens (first difference per prompt): {early}"
