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


SETTINGS = {"ep1": (1, None), "ep2": (2, None),
            "ep2-eplb": (2, EplbSettings(interval=2, redundant_per_rank=1))}
CASES = ("deepseek_v3", "deepseek_v3-q-proj-yarn")


def _rank(rank: int, tp_group, jobs: list[tuple]) -> list:
    from common.layers.moe import expert_load_stats
    from common.models.loader import load_model

    out = []
    for d, ep_size, eplb in jobs:
        model, cfg = load_model(d, tp_rank=rank, tp_size=2, tp_group=tp_group, ep_size=ep_size, eplb=eplb)
        assert cfg.local_kv_heads(2) == 1 and cfg.kv_shared  # the latent row, on both ranks
        logits = teacher_forced_logits(model, cfg, IDS, PREFILL, tp_size=2).numpy()
        out.append((logits, expert_load_stats(model).get("moe_eplb_rebalances", 0)))
    return out


@pytest.fixture(scope="module")
def tp2_runs(make_tiny_model):
    """Both cases under every setting, in one pair of rank processes: {(case, setting): (rank 0's logits,
    rank 1's, rebalances)}."""
    dirs = {c: make_tiny_model(ARCH_CASES[c][0], **ARCH_CASES[c][1]) for c in CASES}
    keys = [(c, s) for s in SETTINGS for c in CASES]
    got = run_ranks(_rank, [(dirs[c], *SETTINGS[s]) for c, s in keys])
    return dirs, {k: (got[0][i][0], got[1][i][0], got[0][i][1]) for i, k in enumerate(keys)}


@pytest.mark.parametrize("setting", SETTINGS)
def test_deepseek_tp2_matches_hf(tp2_runs, setting):
    dirs, runs = tp2_runs
    for case, d in dirs.items():
        r0, r1, rebalances = runs[(case, setting)]
        r0, r1 = torch.from_numpy(r0), torch.from_numpy(r1)
        assert torch.equal(r0, r1), "ranks disagree"
        assert (r0 - hf_logits(d, IDS)).abs().max().item() < TOL, d
        # the balancer moved copies mid-sequence
        assert (rebalances > 0) == (SETTINGS[setting][1] is not None)
