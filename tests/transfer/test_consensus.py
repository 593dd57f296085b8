"""poll_and_all_reduce over a real 2-process gloo group: a failure on one rank wins everywhere, and
share_failure_reasons tells every rank why."""

from __future__ import annotations

import multiprocessing as mp

from tests.transfer.kv_harness import free_port
from transfer.base import KVPoll


class _Fixed:
    def __init__(self, state: KVPoll) -> None:
        self.state = state

    def poll(self) -> KVPoll:
        return self.state


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from transfer.consensus import poll_and_all_reduce, share_failure_reasons

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mine = [KVPoll.Success, KVPoll.Failed if rank == 1 else KVPoll.Transferring, KVPoll.Success]
        polls = [int(x) for x in poll_and_all_reduce([_Fixed(s) for s in mine])]
        # three failed rooms: seen by rank 1 only, by both, by neither
        own = ["aborted by the decode side" if rank == 1 else None, f"timeout on rank {rank}", None]
        out.put((rank, polls, share_failure_reasons(own)))
    finally:
        dist.destroy_process_group()


def test_failure_on_one_rank_wins():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
    expected = [int(KVPoll.Success), int(KVPoll.Failed), int(KVPoll.Success)]
    assert results[0][0] == expected and results[1][0] == expected
    assert results[0][1] == ["aborted by the decode side (seen by TP rank 1)", "timeout on rank 0", None]
    assert results[1][1] == ["aborted by the decode side", "timeout on rank 1", None]


def test_without_group_returns_local_polls():
    from transfer.consensus import poll_and_all_reduce, share_failure_reasons

    assert poll_and_all_reduce([_Fixed(KVPoll.Bootstrapping)]) == [KVPoll.Bootstrapping]
    assert share_failure_reasons(["peer lost", None]) == ["peer lost", None]
