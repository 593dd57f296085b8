"""bench/prefill_phases.py: a prefill's time split by phase through hooks on the real model's modules (tiny
Llama): every phase is timed, the phases add up to the forward, and the projections' rates are counted
from their weights."""

from __future__ import annotations

import pytest

from bench import prefill_phases
from bench.engine import OurEngine


def test_the_phases_add_up_to_the_forward(tiny_model_dir):
    engine = OurEngine(tiny_model_dir, 96, 1)
    prompt = list(range(5, 69))
    out = prefill_phases.measure(engine, prompt, 1)
    sec = out["seconds"]
    assert set(sec) == {*prefill_phases.PHASES, "total"}
    for name in ("norms", "qkv_proj", "attention", "o_proj", "mlp"):
        assert sec[name] > 0, name
    assert sum(sec[k] for k in prefill_phases.PHASES) == pytest.approx(sec["total"])
    assert sum(out["share"].values()) == pytest.approx(1.0)
    assert all(v > 0 for v in out["gflops"].values())
    # FLOPs counted over the rows each projection ran on: every layer's q/k/v over the 64 tokens, the
    # last layer's MLP over the one row whose logits are wanted
    layers = engine.runner.model.model.layers
    per = {name: prefill_phases._weights([getattr(layers[0].self_attn, name)])
           for name in ("qkv_proj", "o_proj")}
    mlp = prefill_phases._weights([layers[0].mlp])
    assert out["flops"]["qkv_proj"] == 2 * per["qkv_proj"] * 64 * len(layers)
    assert out["flops"]["o_proj"] == 2 * per["o_proj"] * 64 * len(layers)
    assert out["flops"]["mlp"] == 2 * mlp * (64 * (len(layers) - 1) + 1)
    assert "mlp" in prefill_phases.describe(out)
    # the hooks are gone: a forward afterwards is not timed into anything
    assert not any(m._forward_hooks for m in engine.runner.model.modules())
