"""TP-2 loading in two real gloo processes: each rank loads its slice of the weights, and the two ranks'
logits equal each other and the TP-1 model's (llama, qwen3, and qwen2 with one KV head). The loader's
checks without processes: tests/unit/test_loader.py."""

from __future__ import annotations

import torch

from common.models.loader import load_model
from tests.model_harness import (
    one_torch_thread,  # noqa: F401  (autouse)
    run_ranks,
    teacher_forced_logits,
    tp_logits,
)


def test_tp2_matches_tp1(make_tiny_model):
    dirs = [make_tiny_model("llama"), make_tiny_model("qwen3"),
            make_tiny_model("qwen2", num_key_value_heads=1)]
    ids = list(range(200, 236))
    prefill = 30
    got = run_ranks(tp_logits, dirs, ids, prefill)
    for i, d in enumerate(dirs):
        ref = teacher_forced_logits(*load_model(d), ids, prefill)
        r0, r1 = torch.from_numpy(got[0][i]), torch.from_numpy(got[1][i])
        assert torch.equal(r0, r1), "ranks disagree"
        assert (r0 - ref).abs().max().item() < 1e-4, d
