"""Greedy decoding on CUDA through ModelRunner, prefill + decode steps as the engine runs them, against
transformers' `generate(do_sample=False)` on the same directory and device: in float32 the tokens must be
identical, for tiny random-weight Llama, Qwen2, Qwen3, Qwen3.5-hybrid and Qwen3-MoE (its experts on the
fused Triton kernels) models, with the torch_native
and triton attention backends, the triton one with and without CUDA graphs (three requests: the decode
batches replay the 4-row graph, one row of padding).

FlashInfer has no float32 kernels (its K/V are float16 / bfloat16), so it runs in bfloat16 here, with and
without graphs, against the torch_native backend in bfloat16: bfloat16 rounding may part two greedy runs
after a while, so the first tokens must agree and the agreement is reported."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import Engine, hf_greedy, needs_flashinfer, prompts, write_result

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_5", "qwen3_moe"]
STEPS = 24


@pytest.fixture(scope="module")
def hf_tokens(make_model):
    cache: dict[str, list[list[int]]] = {}

    def tokens(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_greedy(make_model(arch), prompts(), STEPS)
        return cache[arch]

    return tokens


@pytest.mark.parametrize("backend,graphs", [("torch_native", False), ("triton", False), ("triton", True)])
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_greedy_equals_transformers(make_model, hf_tokens, arch, backend, graphs):
    eng = Engine(make_model(arch), backend, "float32", graphs=graphs)
    ours = eng.generate(prompts(), STEPS)
    assert ours == hf_tokens(arch)
    if graphs:
        assert eng.replays == STEPS - 1


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flashinfer_bfloat16_greedy(make_model, arch, graphs):
    needs_flashinfer()
    ref = Engine(make_model(arch), "torch_native", "bfloat16").generate(prompts(), STEPS)
    eng = Engine(make_model(arch), "flashinfer", "bfloat16", graphs=graphs)
    ours = eng.generate(prompts(), STEPS)
    if graphs:
        assert eng.replays == STEPS - 1
    same = sum(a == b for o, r in zip(ours, ref, strict=True) for a, b in zip(o, r, strict=True))
    write_result(f"flashinfer_bf16_greedy_{arch}_{'graphs' if graphs else 'eager'}",
                 {"tokens": STEPS * len(ref), "agree": same, "fraction": same / (STEPS * len(ref))})
    for o, r in zip(ours, ref, strict=True):
        assert o[:8] == r[:8]
