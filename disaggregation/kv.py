"""The rank's KV manager: built over the runner's pools, with the node's transfer settings.

A role names its manager class (the prefill role `PrefillKVManager`, transfer/sender.py; the decode
role `DecodeKVManager`, transfer/receiver.py) and `build_kv_manager` gives it this rank's share of
the pools: the KV heads (and a hybrid model's state) of its pipeline stage's layers in its DP group,
and the role's metadata rows (`build_metadata`), as `KVArgs.from_runner` describes them. The manager
listens on the address peers reach the node at (`advertised_host`) with the node's timeouts and
secret (`node_settings`: the environment's settings, the node's flags winning).
"""

from __future__ import annotations

import socket
from typing import TypeVar

from disaggregation.requests import MAX_TOP_LOGPROBS
from transfer.base import KVArgs, TransferSettings
from transfer.manager import KVManager
from transfer.metadata import MetadataBuffers

Manager = TypeVar("Manager", bound=KVManager)


def advertised_host(host: str) -> str:
    """An address peers can reach for a listening host setting ("0.0.0.0" is not one)."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def build_kv_manager(manager_cls: type[Manager], args, runner, metadata: MetadataBuffers, tp_rank: int,
                     tp_size: int, *, dp_rank: int = 0, decode_tp: int = 0, **manager_kw) -> Manager:
    """A `manager_cls` for this rank's share of the KV heads (and hybrid state) of its pipeline stage's layers
    in DP group `dp_rank`, with the node's transfer settings. A prefill rank passes the decode TP size it
    serves (`decode_tp`, 0: any) and its `bootstrap_addr` (in `manager_kw`)."""
    stage = {}
    if getattr(runner, "pp_size", 1) > 1:  # a stage sends its own layers (KVArgs' layer ids place them)
        stage = {"pp_rank": runner.pp_rank, "pp_size": runner.pp_size}
    kv_args = KVArgs.from_runner(runner, metadata, engine_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank,
                                 dp_size=getattr(args, "dp_size", 1), decode_tp=decode_tp, **stage)
    return manager_cls(kv_args, args.transfer_backend, settings=node_settings(args),
                       host=advertised_host(args.host), **manager_kw)


def build_metadata(num_slots: int, sched, draft_layers: bool) -> MetadataBuffers:
    """The role's metadata rows: per request, the first token with its logprob and top logprobs and, with
    EAGLE / MTP (`draft_layers`), the first draft and the draft layers' hidden state; pinned on a GPU."""
    return MetadataBuffers(num_slots, max_top_logprobs=MAX_TOP_LOGPROBS,
                           hidden_size=sched.model_config.hidden_size if draft_layers else 0,
                           pinned=sched.runner.device.type == "cuda")


def node_settings(args) -> TransferSettings:
    """The transfer settings of a node: the environment's, with the node's flags winning. A wildcard
    --host asked for every interface, which acknowledges mooncake's wildcard listeners as the flag does."""
    wildcard_ok = getattr(args, "transfer_allow_wildcard_listen", False) or args.host in ("", "0.0.0.0", "::")
    return TransferSettings.from_env(bootstrap_timeout=args.disaggregation_bootstrap_timeout,
                                     waiting_timeout=args.disaggregation_waiting_timeout,
                                     device_name=args.disaggregation_ib_device,
                                     cluster_secret=getattr(args, "cluster_secret", None),
                                     allow_wildcard_listen=True if wildcard_ok else None)
