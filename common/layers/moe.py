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
`run_experts` picks the kernel: on the CPU `moe_native.py`'s single C call while the batch gives the
experts few pairs each (decode), this torch loop over larger batches; on CUDA `triton_moe.py`.

Tensor parallelism splits every expert's intermediate features over the ranks (w13 by output rows, w2
by input columns, as the dense MLP); the partial outputs are summed with the TP all-reduce, once per
block, after the experts. Under DP attention (`common/layers/dp_attention.py`) the block runs over every
DP group's tokens, its experts split over all the node's ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.distributed import get_dp_attention, tensor_model_parallel_all_reduce
from common.layers.activation import silu_and_mul
from common.layers.dp_attention import gather_tokens, own_rows
from common.layers.linear import ReplicatedLinear, _copy_checked
from common.layers.moe_native import native_grouped_experts

NATIVE_MAX_PAIRS_PER_EXPERT = 200  # pairs per expert (on average) up to which the native kernel runs


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
        # -inf, not 0: with a correction bias a searched expert's choice score may be negative
        choice = choice.masked_fill(mask.reshape(t, e) == 0, float("-inf"))
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


class ExpertPlacement:
    """Where each expert's copies live: `replicas[e]` the (EP rank, slot) pairs holding expert `e`, each EP
    rank owning `slots` slots. The home copies (expert `e` in slot `e % per_rank` of EP rank
    `e // per_rank`) never move; the other slots (`--ep-num-redundant-experts / ep_size` a rank) hold the
    replicas `common/layers/eplb.py` places. A (token, choice) pair of expert `e` goes to replica
    `token % len(replicas[e])`: every rank computes the same split from the same routing, so each pair is
    computed once in the group."""

    def __init__(self, num_experts: int, ep_size: int, redundant_per_rank: int = 0) -> None:
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over EP size {ep_size}")
        self.num_experts, self.ep_size = num_experts, ep_size
        self.per_rank = num_experts // ep_size
        self.slots = self.per_rank + redundant_per_rank
        self.set([[(e // self.per_rank, e % self.per_rank)] for e in range(num_experts)])

    def set(self, replicas: list[list[tuple[int, int]]]) -> None:
        self.replicas = replicas
        width = max(len(r) for r in replicas)
        self.count = torch.tensor([len(r) for r in replicas])
        self.rank = torch.tensor([[r[min(i, len(r) - 1)][0] for i in range(width)] for r in replicas])
        self.slot = torch.tensor([[r[min(i, len(r) - 1)][1] for i in range(width)] for r in replicas])
        self._on_device = None

    def home(self, expert: int) -> tuple[int, int]:
        return expert // self.per_rank, expert % self.per_rank

    def mine(self, ids: torch.Tensor, ep_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs of `ids [T, k]` this EP rank computes: (token, choice, slot) index tensors."""
        count, rank, slot = self._tables(ids.device)
        tokens = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        replica = tokens % count[ids]
        tok, choice = (rank[ids, replica] == ep_rank).nonzero(as_tuple=True)
        return tok, choice, slot[ids[tok, choice], replica[tok, choice]]

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._on_device is None or self._on_device[0].device != device:
            self._on_device = (self.count.to(device), self.rank.to(device), self.slot.to(device))
        return self._on_device


class GroupedExperts(nn.Module):
    """This rank's experts: with expert parallelism (`ep_size` > 1) the experts split over the EP ranks
    (`tp_size / ep_size` TP ranks make one EP rank and split its experts' intermediate features), each rank
    computing its experts' pairs for all tokens; the block's TP all-reduce sums the ranks' partial outputs,
    which are disjoint in experts. `placement` says which slot holds which expert (EPLB replicas)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, tp_rank: int = 0, tp_size: int = 1,
                 ep_size: int = 1, redundant_per_rank: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if ep_size < 1 or tp_size % ep_size:
            raise ValueError(f"EP size {ep_size} does not divide TP size {tp_size}")
        moe_tp = tp_size // ep_size
        if inter % moe_tp:
            raise ValueError(f"moe intermediate size {inter} does not split over {moe_tp} ranks of an expert")
        self.num_experts, self.ep_size, self.tp_size = num_experts, ep_size, tp_size
        self.ep_rank, self.moe_tp_rank = tp_rank // moe_tp, tp_rank % moe_tp
        self.placement = ExpertPlacement(num_experts, ep_size, redundant_per_rank)
        self.inter = inter // moe_tp
        slots = self.placement.slots
        self.w13 = nn.Parameter(torch.empty(slots, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, hidden, self.inter, dtype=dtype), requires_grad=False)
        for p, parts in ((self.w13, 2 * num_experts), (self.w2, num_experts)):
            p.weight_loader = self.weight_loader
            p.parts_total = parts  # load_checkpoint: filled once every expert's pieces came (any rank's)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        """`shard`: (expert, "gate" | "up" | "down") for one expert's tensor, or None for the stacked
        tensors transformers writes (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). An expert another EP
        rank keeps is passed over."""
        i, r = self.inter, self.moe_tp_rank
        per, first = self.placement.per_rank, self.ep_rank * self.placement.per_rank
        if shard is None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked experts hold {loaded.shape[0]} experts, the model "
                                 f"{self.num_experts}")
            loaded = loaded[first:first + per]
            if param is self.w13:
                full = loaded.shape[1] // 2
                gate, up = loaded[:, :full], loaded[:, full:]
                loaded = torch.cat([gate[:, r * i:(r + 1) * i], up[:, r * i:(r + 1) * i]], dim=1)
            else:
                loaded = loaded[:, :, r * i:(r + 1) * i]
            _copy_checked(param.data[:per], loaded, "experts")
            return
        expert, part = shard
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the model's {self.num_experts}")
        ep_rank, slot = self.placement.home(expert)
        if ep_rank != self.ep_rank:
            return
        if part == "down":
            _copy_checked(param.data[slot], loaded[:, r * i:(r + 1) * i], f"expert {expert} down")
        else:
            rows = slice(0, i) if part == "gate" else slice(i, 2 * i)
            _copy_checked(param.data[slot, rows], loaded[r * i:(r + 1) * i], f"expert {expert} {part}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:  # every expert here, once (EPLB's spare slots need EP)
            return run_experts(x, self.w13, self.w2, weights, ids)
        tok, choice, slot = self.placement.mine(ids, self.ep_rank)
        out = torch.zeros_like(x)
        if tok.numel():
            part = run_experts(x[tok], self.w13, self.w2, weights[tok, choice].unsqueeze(1),
                               slot.unsqueeze(1))
            out.index_add_(0, tok, part)
        return out


def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """`grouped_experts` on the fastest kernel for the tensors' device: the Triton kernels on CUDA; on the CPU
    the native kernel while the experts get few pairs each (it reads each weight block once for all of an
    expert's pairs, with no per-expert dispatch), torch's GEMMs once a batch gives each used expert
    hundreds (`NATIVE_MAX_PAIRS_PER_EXPERT`, where the measured rates cross)."""
    if x.is_cuda:
        from common.layers.triton_moe import fused_experts

        return fused_experts(x, w13, w2, weights, ids)
    if ids.numel() < NATIVE_MAX_PAIRS_PER_EXPERT * w13.shape[0]:
        out = native_grouped_experts(x, w13, w2, weights, ids)
        if out is not None:
            return out
    return grouped_experts(x, w13, w2, weights, ids)


class SparseMoE(nn.Module):
    """Router + experts of one layer; the output is all-reduced over TP once. `load` counts the (token,
    choice) pairs each expert was picked for since the node started (`/server_info`, the metrics); `eplb`
    (`common/layers/eplb.py`) re-places the replicas from the recent counts every so many forwards."""

    def __init__(self, num_experts: int, hidden: int, inter: int, rule: RoutingRule, *, tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None, ep_size: int = 1, eplb=None,
                 dtype: torch.dtype = torch.float32, reduce: bool = True) -> None:
        super().__init__()
        self.reduce = reduce  # False: the caller sums more partial outputs with this one, then reduces once
        self.rule, self.tp_group, self.eplb = rule, tp_group, eplb
        self.dpa = get_dp_attention()  # DP attention: the experts span every rank of the node
        self.moe_group = tp_group  # the ranks the experts are spread over (EPLB's copies move within it)
        if self.dpa is not None:
            tp_rank, tp_size, self.moe_group = self.dpa.rank, self.dpa.world, self.dpa.world_group
        self.gate = ReplicatedLinear(hidden, num_experts, dtype=dtype)
        redundant = eplb.redundant_per_rank if eplb is not None else 0
        self.experts = GroupedExperts(num_experts, hidden, inter, tp_rank=tp_rank, tp_size=tp_size,
                                      ep_size=ep_size, redundant_per_rank=redundant, dtype=dtype)
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("recent_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.forwards = 0

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of `x`: (weights, expert ids), each `[T, top_k]`."""
        return select_experts(self.gate(x), self.rule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dpa is not None:  # every DP group's tokens, then this group's rows of the sums
            n = x.shape[0]
            x, start = gather_tokens(x, self.dpa)
            out = own_rows(self._experts_out(x, slice(start, start + n)), self.dpa, start, n)
        else:
            out = self._experts_out(x)
        return tensor_model_parallel_all_reduce(out, self.tp_group) if self.reduce else out

    def _experts_out(self, x: torch.Tensor, own: slice | None = None) -> torch.Tensor:
        """This rank's share of the block's output for `x`, with the loads counted (`load`: the rows of
        `own`, this DP group's, default all; EPLB's `recent_load`: all of them, alike on every rank) and
        EPLB's turn taken."""
        weights, ids = self.select(x)
        flat = ids.reshape(-1)  # scatter, not bincount: no host sync, so a CUDA graph can hold it
        ones = torch.ones_like(flat)
        mine = flat if own is None else ids[own].reshape(-1)
        self.load.scatter_add_(0, mine, ones[:mine.numel()])
        if self.eplb is not None:
            self.recent_load.scatter_add_(0, flat, ones)
            self.forwards += 1
            if self.forwards % self.eplb.interval == 0:
                self.eplb.rebalance(self.experts, self.recent_load, self.moe_group)
                self.recent_load.zero_()
        return self.experts(x, weights, ids)


def expert_load_stats(model: nn.Module) -> dict:
    """The model's per-layer expert loads for the scheduler's stats (empty for a dense model)."""
    layers = {name.removeprefix("model.").removesuffix(".mlp"): m for name, m in model.named_modules()
              if isinstance(m, SparseMoE)}
    if not layers:
        return {}
    first = next(iter(layers.values()))
    return {"moe_expert_load": {k: m.load.tolist() for k, m in layers.items()},
            "moe_ep_size": first.experts.ep_size,
            "moe_eplb_rebalances": sum(m.eplb.rebalances for m in layers.values() if m.eplb is not None),
            "moe_expert_replicas": {k: m.experts.placement.count.tolist() for k, m in layers.items()
                                    if m.eplb is not None}}


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
