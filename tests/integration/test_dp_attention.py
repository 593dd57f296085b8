"""DP attention in real gloo processes (common/layers/dp_attention.py): each DP group runs attention over its
own requests while every sparse block runs over all the groups' tokens, its experts spread over all the
ranks. Two groups forward different prompts of different lengths; the one that finishes first runs idle
forwards while the other goes on. Each group's teacher-forced logits equal a single process's for its own
prompt: Qwen3-MoE (experts whole on two ranks, EP 2, and split by features, EP 1, and with EPLB moving
copies between the groups' ranks), DeepSeek-V3 (a dense first layer, shared experts beside the routed
ones) and Qwen3.5-MoE (linear-attention layers, a shared expert), and two groups of TP 2 each (four ranks:
TP attention inside a group, the experts over all four)."""

from __future__ import annotations

import pytest
import torch

from common.layers.eplb import EplbSettings
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
    run_ranks,
    teacher_forced_logits,
)

# (prompt, prefill length) of each DP group: group 0 forwards 7 times, group 1 three times, then idles
PROMPTS = [(list(range(200, 236)), 30), (list(range(90, 104)), 12)]
FORWARDS = 7


def _group_logits(model, cfg, ids: list[int], prefill: int, tp_size: int) -> torch.Tensor:
    from common.layers.dp_attention import idle_forward, sparse_blocks
    from tests.hybrid.hybrid_harness import HybridHarness

    hybrid = getattr(model, "bind_state_pool", None) is not None
    h = HybridHarness(model, cfg, tp_size=tp_size) if hybrid else Harness.for_model(cfg, tp_size=tp_size,
                                                                                   page_size=4)
    row = h.new_req()
    outs = [model(h.extend_batch([(row, ids[:prefill])], all_logits=True))]
    for tok in ids[prefill:]:
        outs.append(model(h.decode_batch([(row, tok)])))
    for _ in range(FORWARDS - len(outs)):  # the other group still runs: take part in its sparse blocks
        idle_forward(sparse_blocks(model), cfg.hidden_size, torch.float32, torch.device("cpu"))
    return torch.cat(outs)


def _rank(rank: int, tp_group, tp_size: int, jobs: list[tuple]) -> list:
    from common.distributed import get_dp_attention
    from common.layers.moe import expert_load_stats
    from common.models.loader import load_model

    dpa = get_dp_attention()
    assert dpa is not None and dpa.dp_rank == rank // tp_size
    ids, prefill = PROMPTS[dpa.dp_rank]
    out = []
    for d, ep_size, eplb in jobs:
        model, cfg = load_model(d, tp_rank=rank % tp_size, tp_size=tp_size, tp_group=tp_group,
                                ep_size=ep_size, eplb=eplb)
        logits = _group_logits(model, cfg, ids, prefill, tp_size).numpy()
        out.append((logits, expert_load_stats(model)))
    return out


EPLB = EplbSettings(interval=2, redundant_per_rank=1)
JOBS = {"qwen3_moe-ep2": ("qwen3_moe", 2, None), "qwen3_moe-ep1": ("qwen3_moe", 1, None),
        "qwen3_moe-ep2-eplb": ("qwen3_moe", 2, EPLB), "deepseek_v3-ep2": ("deepseek_v3", 2, None),
        "qwen3_5_moe-ep2": ("qwen3_5_moe", 2, None)}


@pytest.fixture(scope="module")
def dirs(make_tiny_model):
    return {arch: make_tiny_model(arch) for arch in {j[0] for j in JOBS.values()}}


@pytest.fixture(scope="module")
def two_groups(dirs):
    """Every job on two DP groups of one rank each, in one pair of rank processes."""
    got = run_ranks(_rank, 1, [(dirs[a], ep, eplb) for a, ep, eplb in JOBS.values()],
                    init={"tp_size": 1, "dp_attention": True})
    return {name: {r: got[r][i] for r in (0, 1)} for i, name in enumerate(JOBS)}


def _reference(d: str, group: int) -> torch.Tensor:
    from common.models.loader import load_model
    from tests.hybrid.hybrid_harness import HybridHarness

    ids, prefill = PROMPTS[group]
    model, cfg = load_model(d)
    if getattr(model, "bind_state_pool", None) is None:
        return teacher_forced_logits(model, cfg, ids, prefill)
    h = HybridHarness(model, cfg)
    row = h.new_req()
    outs = [model(h.extend_batch([(row, ids[:prefill])], all_logits=True))]
    outs += [model(h.decode_batch([(row, tok)])) for tok in ids[prefill:]]
    return torch.cat(outs)


@pytest.mark.parametrize("job", list(JOBS))
def test_each_group_gets_its_own_prompts_logits(dirs, two_groups, job):
    arch, ep_size, eplb = JOBS[job]
    got = two_groups[job]
    for group in (0, 1):
        ref = _reference(dirs[arch], group)
        mine = torch.from_numpy(got[group][0])
        assert mine.shape == ref.shape
        assert (mine - ref).abs().max().item() < 1e-4, (job, group)
    stats = got[0][1]
    assert stats["moe_ep_size"] == ep_size
    # each group counts its own tokens' choices (top_k per token, in every layer): 36 and 14 tokens
    per_token = {sum(v) / 36 for v in stats["moe_expert_load"].values()}
    assert len(per_token) == 1 and per_token == {sum(v) / 14 for v in got[1][1]["moe_expert_load"].values()}
    if eplb is not None:  # 7 forwards at an interval of 2: three rebalances per layer, on both groups alike
        assert stats["moe_eplb_rebalances"] == 3 * len(stats["moe_expert_load"]) > 0
        assert stats["moe_expert_replicas"] == got[1][1]["moe_expert_replicas"]


def test_two_groups_of_tp2(dirs):
    """Four ranks: two DP groups, each of TP 2 (its attention heads split over its two ranks), the experts
    of every sparse block whole over all four (EP 4)."""
    got = run_ranks(_rank, 2, [(dirs["qwen3_moe"], 4, None)], world=4,
                    init={"tp_size": 2, "dp_attention": True})
    for rank in range(4):
        ref = _reference(dirs["qwen3_moe"], rank // 2)
        assert (torch.from_numpy(got[rank][0][0]) - ref).abs().max().item() < 1e-4, rank
    assert torch.equal(torch.from_numpy(got[0][0][0]), torch.from_numpy(got[1][0][0]))


def _load_dense(rank: int, tp_group, d: str) -> str:
    from common.models.llama import ModelLoadError
    from common.models.loader import load_model

    try:
        load_model(d, tp_group=tp_group)
    except ModelLoadError as e:
        return str(e)
    return "loaded"


def test_a_dense_model_refuses_dp_attention(make_tiny_model):
    got = run_ranks(_load_dense, make_tiny_model("llama"), init={"tp_size": 1, "dp_attention": True})
    assert all("--enable-dp-attention" in got[r] for r in (0, 1)), got
