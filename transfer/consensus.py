"""TP-wide agreement on transfer states.

Every TP rank of a prefill or decode node polls its own senders/receivers; the scheduler must act on
the same state on every rank. `poll_and_all_reduce` takes the MIN over a gloo process group: since
`KVPoll` orders Failed < Bootstrapping < WaitingForInput < Transferring < Success, a room is Success
only once every rank has it, and a failure on any rank wins.
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
