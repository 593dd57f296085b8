"""DP attention: each DP group of a node runs attention over its own requests (its own KV pool, its own
scheduler), and every mixture-of-experts layer runs over the tokens of all the groups at once, its experts
spread over every rank of the node (`--enable-dp-attention`, `--ep-size` dividing dp * tp).

In a sparse block (`SparseMoE`) a rank of DP group g, TP rank t:
1. gathers the hidden states of every group from the ranks of TP rank t (`gather_tokens`; within a group
   the TP ranks hold the same rows, so one copy per group comes): the token counts first, then the rows,
   padded to the largest count;
2. routes all of them (the router is replicated, so every rank picks the same experts) and computes its
   experts' share, as a rank of a world of dp * tp ranks would;
3. sums the partial outputs over the ranks of TP rank t and keeps its group's rows (`own_rows`); the TP
   all-reduce of the group (or, with shared experts, the block's own) then completes the sum over all
   dp * tp ranks.

So every rank takes part in every sparse block of every forward: the DP groups step in lockstep. Each
scheduler step the groups agree (`Lockstep.agree`, a MAX over the node) whether any of them runs a forward;
one with nothing to run then runs an idle forward (`idle_forward`): each sparse block of the model, in
order, with no tokens of its own. The same agreement carries a stop, so the groups end together, and
whether any group has work: while one does, the others poll their input without waiting (a forward ran) or
every few milliseconds (it waits on a transfer or memory), else every 100 ms; the front end wakes them
with each request it sends to one group (`Wake`), so a new request does not wait for their poll.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common.distributed import DpAttention, get_dp_attention

# torch 2.13 renames all_gather_into_tensor (the GPU image's 2.11 has only the old name)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_tokens(x: torch.Tensor, dpa: DpAttention) -> tuple[torch.Tensor, int]:
    """Every DP group's rows of `x` (`[n, hidden]` here), in DP rank order, and where this group's start."""
    counts = torch.zeros(dpa.dp_size, dtype=torch.int64, device=x.device)
    mine = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    _all_gather(counts, mine, group=dpa.gather_group)
    sizes = counts.tolist()
    most = max(sizes)
    padded = x.new_zeros(most, x.shape[1])
    padded[:x.shape[0]] = x
    parts = x.new_empty(dpa.dp_size * most, x.shape[1])
    _all_gather(parts, padded, group=dpa.gather_group)
    rows = [parts[g * most:g * most + n] for g, n in enumerate(sizes)]
    return torch.cat(rows), sum(sizes[:dpa.dp_rank])


def own_rows(out: torch.Tensor, dpa: DpAttention, start: int, n: int) -> torch.Tensor:
    """The partial outputs of all groups' rows summed over this TP rank's ranks; this group's `n` rows."""
    if not out.is_contiguous():
        out = out.contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=dpa.gather_group)
    return out[start:start + n]


def idle_forward(blocks: list[nn.Module], hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """A forward with no tokens of this group: each of `blocks` (`sparse_blocks(model)`), in order, takes
    part in its collectives."""
    empty = torch.empty(0, hidden, dtype=dtype, device=device)
    for block in blocks:
        block(empty)


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse blocks a forward runs, in order: those under `model.model.layers` (the draft layers of a
    speculative head are not part of a forward)."""
    from common.layers.moe import SparseMoE

    layers = model.model.layers
    return [m for m in layers.modules() if isinstance(m, SparseMoE)]


class Lockstep:
    """The per-step agreement of the DP groups (over the node's gloo lockstep group)."""

    def __init__(self, dpa: DpAttention) -> None:
        self.group = dpa.lockstep_group
        self.others_busy = False  # some group ran a forward at the last agreement
        self.others_waiting = False  # ... or had work that did not run yet (a transfer, memory)

    def agree(self, busy: bool, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """(whether any group runs a forward this step, whether any group stops)."""
        flags = torch.tensor([int(busy), int(has_work), int(stopping)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.others_busy, self.others_waiting = bool(flags[0]), bool(flags[1])
        return self.others_busy, bool(flags[2])


def make_lockstep() -> Lockstep | None:
    """The step agreement of this rank's DP groups (None: no DP attention)."""
    dpa = get_dp_attention()
    return Lockstep(dpa) if dpa is not None else None
