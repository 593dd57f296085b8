"""Tensor- and pipeline-parallel process groups over torch.distributed (gloo on CPU, NCCL for TP on CUDA).

`init_distributed` joins the default process group (one per DP group of a node: its `pp * tp` ranks,
rank = pp_rank * tp + tp_rank) and creates `tp_group` (the ranks of this rank's pipeline stage) for
the model's collectives (all-reduce after row-parallel layers) and `consensus_group` (every rank) for
control-plane agreement (scheduler input broadcast, transfer poll MIN-reduce, the sampled tokens of a
pipelined forward), so the two kinds of traffic never interleave on one group. Hidden states go from
stage to stage point to point on the default group (`pp_isend` / `pp_recv`: TP rank t of stage s to
TP rank t of stage s + 1). A world of 1 (one rank, no TP or PP) joins no process group at all: both
groups are None and every helper is the identity. A gloo world keeps three loop threads that wake up
on their own (~1.2 % of a core while the node idles, measured here) and its rendezvous costs start-up
time; a single rank has nobody to talk to.

With DP attention (`--enable-dp-attention`) the node's DP groups share one world of `dp * tp` ranks (rank =
dp_rank * tp + tp_rank): `tp_group` and `consensus_group` stay the DP group's own, and `get_dp_attention()`
holds the groups a mixture-of-experts layer spans the world with (`DpAttention`): the ranks of one TP rank
across the DP groups (each DP group's tokens gathered, the partial sums reduced back), every rank (EPLB's
weight copies) and a gloo group for the step agreement that keeps the DP groups in lockstep.

The ranks of one node always run on one machine, so their gloo connections stay on loopback:
`init_distributed` points gloo at the loopback interface (`GLOO_SOCKET_IFNAME`), whatever the
host name resolves to. The rendezvous store is the caller's `init_method`; the node launcher uses a
`file://` store in its private (0700) run directory, because torch's TCP store listens on every
interface whatever host the URL names.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TP_GROUP: dist.ProcessGroup | None = None
_CONSENSUS_GROUP: dist.ProcessGroup | None = None
_TP_SIZE = 1


@dataclass
class DpAttention:
    """The world a mixture-of-experts layer spans under DP attention: this rank is `rank` of `world`
    (DP group `dp_rank` of `dp_size`); `gather_group` holds this TP rank of every DP group (group rank =
    DP rank), `world_group` every rank (group rank = world rank), `lockstep_group` every rank, on gloo."""

    dp_rank: int
    dp_size: int
    rank: int
    world: int
    gather_group: dist.ProcessGroup
    world_group: dist.ProcessGroup
    lockstep_group: dist.ProcessGroup


_DP_ATTENTION: DpAttention | None = None


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 ("lo" on Linux)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return "lo"


def init_distributed(rank: int, world_size: int, init_method: str, timeout_s: float = 600.0,
                     tp_size: int | None = None, device: torch.device | None = None,
                     dp_attention: bool = False) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Join the node's world of `world_size` = pp * `tp_size` ranks (default: all one stage) and return
    `(tp_group, consensus_group)`; (None, None) for a world of one rank. On a CUDA `device` the TP groups
    are NCCL groups (the all-reduces of device tensors), and gloo carries everything on the host (the
    consensus group, the objects a stage broadcasts). `dp_attention`: the world is dp * `tp_size` ranks,
    one DP group per block of `tp_size`, each with its own consensus group (`DpAttention`)."""
    global _TP_GROUP, _CONSENSUS_GROUP, _TP_SIZE, _DP_ATTENTION
    cuda = device is not None and device.type == "cuda"
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if world_size == 1 and not dist.is_initialized():
        _TP_GROUP = _CONSENSUS_GROUP = None
        _TP_SIZE = 1
        logger.info("distributed: a world of one rank, no process group")
        return None, None
    if not dist.is_initialized():
        # read by gloo when it creates its device: listen and connect on loopback only
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, asked for rank {rank} of {world_size}")
    tp = tp_size or world_size
    if world_size % tp:
        raise ValueError(f"a world of {world_size} ranks is not whole stages of {tp}")
    _TP_SIZE = tp
    device_backend = "nccl" if cuda else "gloo"
    blocks = world_size // tp  # pipeline stages, or DP groups under DP attention
    for stage in range(blocks):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), backend=device_backend)
        if stage == rank // tp:
            _TP_GROUP = group
    _DP_ATTENTION = None
    if not dp_attention:
        _CONSENSUS_GROUP = dist.new_group(list(range(world_size)), backend="gloo")
    else:
        for g in range(blocks):
            group = dist.new_group(list(range(g * tp, (g + 1) * tp)), backend="gloo")
            if g == rank // tp:
                _CONSENSUS_GROUP = group
        gather = None
        for t in range(tp):
            group = dist.new_group(list(range(t, world_size, tp)), backend=device_backend)
            if t == rank % tp:
                gather = group
        _DP_ATTENTION = DpAttention(rank // tp, blocks, rank, world_size, gather,
                                    dist.new_group(list(range(world_size)), backend=device_backend),
                                    dist.new_group(list(range(world_size)), backend="gloo"))
    logger.info("distributed ready: rank %d of %d (%s, TP over %s)", rank, world_size, init_method,
                "nccl" if cuda else "gloo")
    return _TP_GROUP, _CONSENSUS_GROUP


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_consensus_group() -> dist.ProcessGroup | None:
    return _CONSENSUS_GROUP


def get_dp_attention() -> DpAttention | None:
    """The mixture-of-experts world under DP attention (None: off)."""
    return _DP_ATTENTION


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def tensor_model_parallel_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `x` over the TP group in place and return it (a no-op for one rank)."""
    group = group if group is not None else _TP_GROUP
    if group_size(group) == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                                     dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (identity for one rank)."""
    group = group if group is not None else _TP_GROUP
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class PendingSend:
    """Sends in flight (`pp_isend`): `wait()` before the tensors may change."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []


def pp_isend(tensors: list[torch.Tensor], stage: int) -> PendingSend:
    """Start sending `tensors` (in order) to this TP rank's peer in pipeline stage `stage`."""
    dst = stage * _TP_SIZE + dist.get_rank() % _TP_SIZE
    tensors = [t.contiguous() for t in tensors]
    return PendingSend([dist.isend(t, dst) for t in tensors], tensors)


def pp_recv(tensors: list[torch.Tensor], stage: int) -> None:
    """Receive into `tensors` (in order) from this TP rank's peer in pipeline stage `stage`."""
    src = stage * _TP_SIZE + dist.get_rank() % _TP_SIZE
    for t in tensors:
        dist.recv(t, src)


def broadcast_from_stage(obj, stage: int):
    """`obj` of TP rank 0 of pipeline stage `stage`, on every rank of the world (pickled)."""
    box = [obj]
    dist.broadcast_object_list(box, src=stage * _TP_SIZE, group=_CONSENSUS_GROUP)
    return box[0]


def destroy_distributed() -> None:
    global _TP_GROUP, _CONSENSUS_GROUP, _DP_ATTENTION
    _TP_GROUP = _CONSENSUS_GROUP = _DP_ATTENTION = None
    if dist.is_initialized():
        dist.destroy_process_group()
