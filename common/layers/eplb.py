"""Expert-parallel load balancing (`--enable-eplb`): replicas of the busiest experts in each EP rank's spare
slots, re-placed from the loads measured every `--eplb-rebalance-num-iterations` forwards.

With expert parallelism the experts split over the EP ranks and every rank computes its experts' share of
the batch (`common/layers/moe.py`); the block's all-reduce waits for the slowest rank, so a rank whose experts
the router favours sets the step time. Each EP rank has `--ep-num-redundant-experts / ep-size` spare slots.
A rebalance, run by every rank of the group at the same forward from the same counts (the routing and so
the counts are the same on every rank), does:

1. **How many copies:** one spare copy at a time to the expert with the most pairs per copy, at most one
   copy per EP rank.
2. **Where:** the extra copies in decreasing order of their share of pairs, each to the rank with the least
   load that has a free spare slot and no copy of that expert yet, and only if that lowers the busiest of
   the expert's holders (so an even load places none); a rank's load is the sum over the copies it holds so
   far of their experts' pairs divided by the expert's copies.
3. **Weights:** each copy that lands in a slot holding something else is sent from its home rank (one
   point-to-point send per expert shard, in the same order on every rank, so no rank waits on a later move
   before an earlier one completes); then the new placement takes effect. The home copies never move, so a
   request in flight meets either placement's complete set of experts.

The pairs of an expert with `c` copies split by token index modulo `c` (`ExpertPlacement.mine`), so a hot
expert's tokens are computed by `c` ranks side by side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.distributed import get_tp_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EplbSettings:
    interval: int  # forwards between rebalances (--eplb-rebalance-num-iterations)
    redundant_per_rank: int  # spare expert slots on each EP rank (--ep-num-redundant-experts / ep-size)


class Eplb:
    """The balancer's settings and its count of rebalances; one instance per MoE layer."""

    def __init__(self, interval: int, redundant_per_rank: int, layer_id: int | None = None) -> None:
        if interval < 1 or redundant_per_rank < 1:
            raise ValueError("EPLB needs a rebalance interval ≥ 1 and at least one spare slot per EP rank")
        self.interval, self.redundant_per_rank, self.layer_id = interval, redundant_per_rank, layer_id
        self.rebalances = 0

    @classmethod
    def for_layer(cls, settings: EplbSettings | None, layer_id: int) -> Eplb | None:
        """Layer `layer_id`'s balancer under `settings` (None: no EPLB)."""
        return None if settings is None else cls(settings.interval, settings.redundant_per_rank, layer_id)

    def rebalance(self, experts, load: torch.Tensor, group) -> None:
        placement = experts.placement
        counts = load.tolist()
        if not sum(counts):
            return
        new = plan(counts, placement.ep_size, placement.per_rank, placement.slots)
        before = imbalance(counts, placement.replicas, placement.ep_size)
        moved = move_weights(experts, placement.replicas, new, group)
        placement.set(new)
        self.rebalances += 1
        logger.info("eplb: layer %s rebalanced on %d pairs: %d copies moved, rank-load imbalance "
                    "(max / mean) %.2f -> %.2f", self.layer_id, sum(counts), moved, before,
                    imbalance(counts, new, placement.ep_size))


def plan(load: list[int], ep_size: int, per_rank: int, slots: int) -> list[list[tuple[int, int]]]:
    """The replicas of every expert, `[(ep_rank, slot), ...]` with the home copy first."""
    n = len(load)
    copies = [1] * n
    for _ in range((slots - per_rank) * ep_size):
        best = max((e for e in range(n) if copies[e] < ep_size), key=lambda e: (load[e] / copies[e], -e),
                   default=None)
        if best is None:
            break
        copies[best] += 1
    replicas = [[(e // per_rank, e % per_rank)] for e in range(n)]
    rank_load = [0.0] * ep_size  # of the copies placed so far
    for e in range(n):
        rank_load[e // per_rank] += load[e]
    free = [list(range(per_rank, slots)) for _ in range(ep_size)]
    extra = sorted((e for e in range(n) for _ in range(copies[e] - 1)),
                   key=lambda e: (-load[e] / copies[e], e))
    for e in extra:
        holders = [r for r, _ in replicas[e]]
        ranks = [r for r in range(ep_size) if free[r] and r not in holders]
        if not ranks:
            continue
        r = min(ranks, key=lambda g: (rank_load[g], g))
        old, new = load[e] / len(holders), load[e] / (len(holders) + 1)
        # a copy only where it lowers the busiest of the ranks it touches (under an even load, none)
        if not load[e] or rank_load[r] + new >= max(rank_load[h] for h in holders):
            continue
        for h in holders:
            rank_load[h] += new - old
        rank_load[r] += new
        replicas[e].append((r, free[r].pop(0)))
    return replicas


def imbalance(load: list[int], replicas: list[list[tuple[int, int]]], ep_size: int) -> float:
    """Max over mean of the ranks' pairs under `replicas` (1.0: perfectly even)."""
    per = [0.0] * ep_size
    for e, reps in enumerate(replicas):
        for r, _ in reps:
            per[r] += load[e] / len(reps)
    mean = sum(per) / ep_size
    return max(per) / mean if mean else 1.0


def move_weights(experts, old: list[list[tuple[int, int]]], new: list[list[tuple[int, int]]], group) -> int:
    """Fill every spare slot whose expert changes from the expert's home rank; returns the copies moved."""
    held = {(r, s): e for e, reps in enumerate(old) for r, s in reps}
    moves = sorted((r, s, e) for e, reps in enumerate(new) for r, s in reps[1:] if held.get((r, s)) != e)
    group = group if group is not None else get_tp_group()
    moe_tp = experts.tp_size // experts.ep_size
    me = experts.ep_rank * moe_tp + experts.moe_tp_rank
    for r, s, e in moves:
        home_rank, home_slot = experts.placement.home(e)
        src, dst = home_rank * moe_tp + experts.moe_tp_rank, r * moe_tp + experts.moe_tp_rank
        for w in (experts.w13, experts.w2):
            if me == src:
                dist.send(w.data[home_slot].contiguous(), dist.get_global_rank(group, dst), group=group)
            elif me == dst:
                buf = torch.empty_like(w.data[s])
                dist.recv(buf, dist.get_global_rank(group, src), group=group)
                w.data[s].copy_(buf)
    return len(moves)
