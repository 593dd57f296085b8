"""DeepSeek-V3 (tiny, common/models/deepseek_v3.py) at TP 2 in two real gloo processes: each rank holds
half the query heads (its rows of q_b_proj / q_proj and kv_b_proj, its columns of o_proj) and the whole
latent row of every token in its single-plane cache; the routed experts split by features (EP 1) or whole
over the ranks (EP 2, also with EPLB moving spare copies every 2 forwards), the shared expert by features.
Both ranks' teacher-forced logits (an extend, then decode steps) equal each other and transformers'."""

from __future__ import annotations

import pytest
import torch

from common.layers.eplb import EplbSettings
from tests.model_harness import (
    one_torch_thread,  # noqa: F401  (autouse)
    run_ranks,
    teacher_forced_logits,
)
from tests.unit.test_model_vs_hf import ARCH_CASES, TOL, hf_logits

IDS = list(range(200, 236))
PREFILL = 30


def _rank(rank: int, tp_group, dirs: list[str], ep_size: int, eplb) -> list:
    from common.layers.moe import expert_load_stats
    from common.models.loader import load_model

    out = []
    for d in dirs:
        model, cfg = load_model(d, tp_rank=rank, tp_size=2, tp_group=tp_group, ep_size=ep_size, eplb=eplb)
        assert cfg.local_kv_heads(2) == 1 and cfg.kv_shared  # the latent row, on both ranks
        logits = teacher_forced_logits(model, cfg, IDS, PREFILL, tp_size=2).numpy()
        out.append((logits, expert_load_stats(model).get("moe_eplb_rebalances", 0)))
    return out


@pytest.mark.parametrize("ep_size,eplb", [(1, None), (2, None),
                                          (2, EplbSettings(interval=2, redundant_per_rank=1))],
                         ids=["ep1", "ep2", "ep2-eplb"])
def test_deepseek_tp2_matches_hf(make_tiny_model, ep_size, eplb):
    cases = ("deepseek_v3", "deepseek_v3-q-proj-yarn")
    dirs = [make_tiny_model(ARCH_CASES[c][0], **ARCH_CASES[c][1]) for c in cases]
    got = run_ranks(_rank, dirs, ep_size, eplb)
    for i, d in enumerate(dirs):
        ref = hf_logits(d, IDS)
        r0, r1 = torch.from_numpy(got[0][i][0]), torch.from_numpy(got[1][i][0])
        assert torch.equal(r0, r1), "ranks disagree"
        assert (r0 - ref).abs().max().item() < TOL, d
        assert (got[0][i][1] > 0) == (eplb is not None)  # the balancer moved copies mid-sequence
