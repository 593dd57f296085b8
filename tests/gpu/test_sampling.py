"""Seeded sampling on the device: the same seeds give the same tokens twice (with CUDA graphs), other
seeds other tokens."""

from __future__ import annotations

from common.protocol import SamplingParams
from tests.gpu.conftest import Engine, prompts

STEPS = 32


def test_same_seed_same_tokens(make_model):
    eng = Engine(make_model("llama"), "triton", "float32", graphs=True)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50)
    ps = prompts()
    first = eng.generate(ps, STEPS, params=params, seeds=[11, 12, 13])
    again = eng.generate(ps, STEPS, params=params, seeds=[11, 12, 13])
    other = eng.generate(ps, STEPS, params=params, seeds=[21, 22, 23])
    assert first == again
    assert first != other
    assert eng.replays == 3 * (STEPS - 1)
