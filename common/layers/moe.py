"""Mixture-of-experts: the router's top-k choice and the experts' computation over a batch.

A sparse MLP block holds a router (`gate`, a `[num_experts, hidden]` linear) and `num_experts`
SiLU-gated MLPs. For each token the router picks `top_k` experts and their weights; the block's output
is the weighted sum of those experts' outputs.

`RoutingRule` says how the router's logits become `(weights, expert ids)`, the way each family does it:
* Mixtral, Qwen3-MoE: softmax over all experts in float32, the top k, renormalised to sum to one when
  the config says so (`norm_topk_prob`; Mixtral always does).
* sigmoid scoring with grouped top-k (the DeepSeek-V3 rule, `scoring="sigmoid"`, `n_group`, `topk_group`,
  a per-expert correction bias that only steers the choice, and `routed_scaling` on the weights).

`SparseMoE.experts` is `GroupedExperts`: the experts' gate/up weights stacked as `w13
[experts, 2 * inter, hidden]` and the down weights as `w2 [experts, hidden, inter]`. Its forward sorts
the batch's (token, choice) pairs by expert and runs each expert that was picked once, on all its tokens
together, then adds the weighted rows back to their tokens: one matmul pair per expert used, not one per
token.

Tensor parallelism splits every expert's intermediate features over the ranks (w13 by output rows, w2
by input columns, as the dense MLP); the partial outputs are summed with the TP all-reduce, once per
block, after the experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.distributed import tensor_model_parallel_all_reduce
from common.layers.activation import silu_and_mul
from common.layers.linear import ReplicatedLinear, _copy_checked


@dataclass(frozen=True)
class RoutingRule:
    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True
    n_group: int = 1  # grouped top-k: experts in n_group groups, the best topk_group groups searched
    topk_group: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring {self.scoring!r} (softmax, sigmoid)")


def select_experts(logits: torch.Tensor, rule: RoutingRule,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [T, E]` -> (`weights [T, k]` float32, `ids [T, k]` int64)."""
    logits = logits.float()
    scores = logits.softmax(-1) if rule.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if rule.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, rule.n_group, e // rule.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # each group by its best two
        keep = group_scores.topk(rule.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).unsqueeze(-1).expand_as(grouped)
        choice = choice.masked_fill(mask.reshape(t, e) == 0, 0.0)
    ids = choice.topk(rule.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if rule.scoring == "sigmoid" else 0.0))
    if rule.routed_scaling != 1.0:
        weights = weights * rule.routed_scaling
    return weights, ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) for every token t; each used expert runs once."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    rows = x[tokens]
    out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            part = rows[start:start + n]
            out[start:start + n] = F.linear(silu_and_mul(F.linear(part, w13[e])), w2[e])
            start += n
    out.mul_(weights.reshape(-1)[order].to(out.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, out)


class GroupedExperts(nn.Module):
    """This rank's share of every expert (its slice of the intermediate features)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if inter % tp_size:
            raise ValueError(f"moe intermediate size {inter} does not split over TP size {tp_size}")
        self.num_experts, self.tp_rank = num_experts, tp_rank
        self.inter = inter // tp_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter, dtype=dtype), requires_grad=False)
        for p, parts in ((self.w13, 2 * num_experts), (self.w2, num_experts)):
            p.weight_loader = self.weight_loader
            p.parts_total = parts  # load_checkpoint: filled once every expert's pieces came

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        """`shard`: (expert, "gate" | "up" | "down") for one expert's tensor, or None for the stacked
        tensors transformers writes (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)."""
        i, r = self.inter, self.tp_rank
        if shard is None:
            if param is self.w13:
                full = loaded.shape[1] // 2
                gate, up = loaded[:, :full], loaded[:, full:]
                loaded = torch.cat([gate[:, r * i:(r + 1) * i], up[:, r * i:(r + 1) * i]], dim=1)
            else:
                loaded = loaded[:, :, r * i:(r + 1) * i]
            _copy_checked(param, loaded, "experts")
            return
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the model's {self.num_experts}")
        if part == "down":
            _copy_checked(param.data[expert], loaded[:, r * i:(r + 1) * i], f"expert {expert} down")
        else:
            rows = slice(0, i) if part == "gate" else slice(i, 2 * i)
            _copy_checked(param.data[expert, rows], loaded[r * i:(r + 1) * i], f"expert {expert} {part}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, self.w13, self.w2, weights, ids)


class SparseMoE(nn.Module):
    """Router + experts of one layer; the output is all-reduced over TP once."""

    def __init__(self, num_experts: int, hidden: int, inter: int, rule: RoutingRule, *, tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None, dtype: torch.dtype = torch.float32,
                 reduce: bool = True) -> None:
        super().__init__()
        self.reduce = reduce  # False: the caller sums more partial outputs with this one, then reduces once
        self.rule, self.tp_group = rule, tp_group
        self.gate = ReplicatedLinear(hidden, num_experts, dtype=dtype)
        self.experts = GroupedExperts(num_experts, hidden, inter, tp_rank=tp_rank, tp_size=tp_size,
                                      dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.rule)
        out = self.experts(x, weights, ids)
        return tensor_model_parallel_all_reduce(out, self.tp_group) if self.reduce else out


# checkpoint names of one expert's tensors: `...experts.<e>.<gate_proj|up_proj|down_proj|w1|w3|w2>.weight`
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def expert_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """The parameter (and shard) an expert tensor of the checkpoint goes to; None for other tensors."""
    m = _EXPERT.match(name)
    if m:
        part = _PART[m.group(3)]
        return f"{m.group(1)}.{'w2' if part == 'down' else 'w13'}", (int(m.group(2)), part)
    head, _, last = name.rpartition(".")
    if head.endswith(".experts") and last in _STACKED:
        return f"{head}.{_STACKED[last]}", None
    return None
