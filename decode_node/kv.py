"""The decode rank's KVManager, over the runner's KV pool and the metadata buffers."""

from __future__ import annotations

import socket

from transfer.base import KVArgs, TransferSettings
from transfer.manager import KVManager
from transfer.metadata import MetadataBuffers

# first-token top logprobs carried from the prefill node (requests asking for more are refused)
MAX_TOP_LOGPROBS = 20


def advertised_host(host: str) -> str:
    """An address peers can reach for a listening host setting ("0.0.0.0" is not one)."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def build_kv_manager(args, runner, metadata: MetadataBuffers, tp_rank: int, tp_size: int, role: str) -> KVManager:
    """One KVManager for this rank's share of the KV heads."""
    kv_args = KVArgs.from_pool(runner.kv_pool, metadata, engine_rank=tp_rank, tp_size=tp_size,
                               model=runner.model_config.name, **runner.hybrid.transfer_kwargs())
    settings = TransferSettings.from_env(bootstrap_timeout=args.disaggregation_bootstrap_timeout,
                                         waiting_timeout=args.disaggregation_waiting_timeout)
    return KVManager(kv_args, role, args.transfer_backend, settings=settings, host=advertised_host(args.host))
