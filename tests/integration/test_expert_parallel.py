"""Expert parallelism in two real gloo processes: with `ep_size` 2 each rank holds half the experts (whole)
and computes their share of every token; the TP all-reduce sums the halves. Logits equal the TP-1 model's
for Qwen3-MoE and Mixtral, with and without EPLB moving replicas between the ranks mid-sequence."""

from __future__ import annotations

import pytest
import torch

from common.layers.eplb import EplbSettings
from common.models.loader import load_model
from tests.model_harness import (
    one_torch_thread,  # noqa: F401  (autouse)
    run_ranks,
    teacher_forced_logits,
)

IDS = list(range(200, 236))
PREFILL = 30


def _rank(rank: int, tp_group, jobs: list[tuple]) -> list:
    from common.layers.moe import expert_load_stats

    out = []
    for d, eplb in jobs:
        model, cfg = load_model(d, tp_rank=rank, tp_size=2, tp_group=tp_group, ep_size=2, eplb=eplb)
        logits = teacher_forced_logits(model, cfg, IDS, PREFILL, tp_size=2).numpy()
        out.append((logits, expert_load_stats(model)))
    return out


EPLB = EplbSettings(interval=2, redundant_per_rank=1)
JOBS = (("qwen3_moe", None), ("mixtral", None), ("qwen3_moe", EPLB))


@pytest.fixture(scope="module")
def ep2_runs(make_tiny_model):
    """Every job in one pair of rank processes: {job: (model dir, {rank: (logits, expert stats)})}."""
    dirs = {arch: make_tiny_model(arch) for arch, _ in JOBS}
    got = run_ranks(_rank, [(dirs[arch], eplb) for arch, eplb in JOBS])
    return {job: (dirs[job[0]], {r: got[r][i] for r in (0, 1)}) for i, job in enumerate(JOBS)}


def _check(d: str, got: dict) -> None:
    ref = teacher_forced_logits(*load_model(d), IDS, PREFILL)
    r0, r1 = torch.from_numpy(got[0][0]), torch.from_numpy(got[1][0])
    assert torch.equal(r0, r1), "ranks disagree"
    assert (r0 - ref).abs().max().item() < 1e-4, d


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_ep2_matches_tp1(ep2_runs, arch):
    d, got = ep2_runs[(arch, None)]
    _check(d, got)
    stats = got[0][1]
    assert stats["moe_ep_size"] == 2
    loads = stats["moe_expert_load"]
    # every layer saw each of the 36 tokens pick top_k = 2 experts
    assert loads and all(sum(v) == len(IDS) * 2 for v in loads.values()), loads
    assert got[1][1]["moe_expert_load"] == loads, "the ranks count the same routing"


def test_eplb_replicas_keep_logits(ep2_runs):
    """Rebalances every 2 forwards (7 forwards: a prefill and 6 decode steps), one spare slot per rank:
    each fills a spare over the wire where a copy unloads the busier rank; the logits stay exact."""
    d, got = ep2_runs[("qwen3_moe", EPLB)]
    _check(d, got)
    stats = got[0][1]
    layers = len(stats["moe_expert_load"])
    assert stats["moe_eplb_rebalances"] == 3 * layers
    # copies went over the wire where they unload the busier rank (the last window's placement: some
    # layers hold one), never more than the two spares
    copies = stats["moe_expert_replicas"]
    assert any(sum(c) > 4 for c in copies.values()) and all(sum(c) <= 4 + 2 for c in copies.values()), copies


def test_dense_model_refuses_ep(make_tiny_model):
    from common.models.llama import ModelLoadError

    with pytest.raises(ModelLoadError, match="--ep-size"):
        load_model(make_tiny_model("llama"), ep_size=2)
