"""TP-wide agreement on transfer states.

Every TP rank of a prefill or decode node polls its own senders/receivers; the scheduler must act on
the same state on every rank. `poll_and_all_reduce` takes the MIN over a gloo process group: since
`KVPoll` orders Failed < Bootstrapping < WaitingForInput < Transferring < Success, a room is Success
only once every rank has it, and a failure on any rank wins. `share_failure_reasons` then tells every
rank why: the rank that answers the client may not have seen the failure itself yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from transfer.base import KVPoll


def poll_and_all_reduce(pollers: Sequence, group=None) -> list[KVPoll]:
    """Poll every sender/receiver and reduce the states with MIN over `group`.

    `group` is a gloo process group (or None for the default one); without an initialised process
    group, or with a group of one rank, the local polls are returned unchanged."""
    polls = torch.tensor([int(p.poll()) for p in pollers], dtype=torch.int32)
    if polls.numel() and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(polls, op=dist.ReduceOp.MIN, group=group)
    return [KVPoll(int(x)) for x in polls.tolist()]


def share_failure_reasons(reasons: Sequence[str | None], group=None) -> list[str | None]:
    """For each failed room, the first reason any rank of `group` has (this rank's own first); None where no
    rank saw the failure itself yet. A collective: every rank calls it with one entry per failed room, in
    the same order, as they do after the same MIN poll."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return list(reasons)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(reasons), group=group)
    rank = dist.get_rank(group)
    ranks = [rank] + [r for r in range(len(gathered)) if r != rank]
    out: list[str | None] = []
    for i in range(len(reasons)):
        seen = [(r, gathered[r][i]) for r in ranks if gathered[r][i] is not None]
        if not seen:
            out.append(None)
        else:
            r, reason = seen[0]
            out.append(reason if r == rank else f"{reason} (seen by TP rank {r})")
    return out
