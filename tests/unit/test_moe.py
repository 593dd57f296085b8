"""The mixture-of-experts layer (common/layers/moe.py): routing rules, the grouped expert computation
against a per-token sum, the TP split of the experts, and the checkpoint names it accepts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers.moe import GroupedExperts, RoutingRule, expert_target, grouped_experts, select_experts


def _per_token(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            g, u = F.linear(x[t], w13[e]).chunk(2)
            out[t] += w * F.linear(F.silu(g) * u, w2[e])
    return out


def test_grouped_experts_equal_per_token_sum():
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(9, 16, generator=g), torch.randn(6, 24, 16, generator=g), torch.randn(6, 16, 12,
                                                                                                    generator=g)
    weights, ids = select_experts(torch.randn(9, 6, generator=g), RoutingRule(top_k=2))
    assert torch.allclose(grouped_experts(x, w13, w2, weights, ids), _per_token(x, w13, w2, weights, ids),
                          atol=1e-5)


def test_softmax_rule_renormalises_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, ids = select_experts(logits, RoutingRule(top_k=2))
    assert sorted(ids[0].tolist()) == [2, 3] and abs(w.sum().item() - 1.0) < 1e-6
    w, _ = select_experts(logits, RoutingRule(top_k=2, renormalize=False))
    assert w.sum().item() < 1.0


def test_grouped_sigmoid_rule_searches_the_best_groups_and_scales():
    # 8 experts in 4 groups; the bias steers the choice to group 0 but the weights are the raw scores
    logits = torch.tensor([[0.0, 0.1, 5.0, 0.0, 4.0, 4.0, 0.2, 0.3]])
    bias = torch.tensor([9.0, 9.0, 0, 0, 0, 0, 0, 0])
    rule = RoutingRule(top_k=2, scoring="sigmoid", n_group=4, topk_group=1, routed_scaling=2.5)
    w, ids = select_experts(logits, rule, bias)
    assert sorted(ids[0].tolist()) == [0, 1]
    assert abs(w.sum().item() - 2.5) < 1e-5
    w, ids = select_experts(logits, RoutingRule(top_k=2, scoring="sigmoid", n_group=4, topk_group=1))
    assert sorted(ids[0].tolist()) == [4, 5]  # group 2's best two beat group 1's 5.0 + 0.0


def test_tp_shards_sum_to_the_whole():
    g = torch.Generator().manual_seed(1)
    full13, full2 = torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g)  # inter 8
    x = torch.randn(5, 8, generator=g)
    weights, ids = select_experts(torch.randn(5, 4, generator=g), RoutingRule(top_k=2))
    whole = grouped_experts(x, full13, full2, weights, ids)
    parts = []
    for rank in range(2):
        ex = GroupedExperts(4, 8, 8, tp_rank=rank, tp_size=2)
        for e in range(4):  # the per-expert checkpoint names
            ex.weight_loader(ex.w13, full13[e, :8], (e, "gate"))
            ex.weight_loader(ex.w13, full13[e, 8:], (e, "up"))
            ex.weight_loader(ex.w2, full2[e], (e, "down"))
        parts.append(ex(x, weights, ids))
        stacked = GroupedExperts(4, 8, 8, tp_rank=rank, tp_size=2)  # transformers' stacked tensors
        stacked.weight_loader(stacked.w13, full13)
        stacked.weight_loader(stacked.w2, full2)
        assert torch.equal(stacked.w13, ex.w13) and torch.equal(stacked.w2, ex.w2)
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)


def test_checkpoint_names():
    assert expert_target("model.layers.3.mlp.experts.7.up_proj.weight") == ("model.layers.3.mlp.experts.w13",
                                                                           (7, "up"))
    assert expert_target("model.layers.0.mlp.experts.2.w2.weight") == ("model.layers.0.mlp.experts.w2",
                                                                      (2, "down"))
    assert expert_target("model.layers.0.mlp.experts.gate_up_proj") == ("model.layers.0.mlp.experts.w13",
                                                                        None)
    assert expert_target("model.layers.0.mlp.gate.weight") is None
    ex = GroupedExperts(2, 8, 8)
    with pytest.raises(ValueError, match="expert 5"):
        ex.weight_loader(ex.w13, torch.zeros(8, 8), (5, "gate"))
    with pytest.raises(ValueError, match="shape"):
        ex.weight_loader(ex.w2, torch.zeros(8, 4), (0, "down"))
