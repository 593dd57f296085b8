"""The prefill rank's transfer objects: its KVManager (over the runner's KV pool and the metadata
buffers) and, on rank 0, the node's bootstrap server.

The bootstrap server runs in the scheduler process of rank 0, not in the HTTP front end: `common/`
(the front end) must not depend on `transfer/`, and the server then lives exactly as long as the
ranks it describes — when the scheduler dies the decode side stops finding it, which is the signal
it needs. Rank 0 binds the server before it builds its own manager; the other ranks' managers retry
their registration until the server answers.
"""

from __future__ import annotations

import logging
import socket

from transfer.base import KVArgs, TransferSettings
from transfer.bootstrap import BootstrapServer
from transfer.manager import KVManager
from transfer.metadata import MetadataBuffers

logger = logging.getLogger("prefill")

# first-token top logprobs carried to the decode node (requests asking for more are refused)
MAX_TOP_LOGPROBS = 20


def advertised_host(host: str) -> str:
    """An address peers can reach for a listening host setting ("0.0.0.0" is not one)."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def transfer_settings(args) -> TransferSettings:
    return TransferSettings.from_env(bootstrap_timeout=args.disaggregation_bootstrap_timeout,
                                     waiting_timeout=args.disaggregation_waiting_timeout)


def start_bootstrap_server(args) -> BootstrapServer:
    server = BootstrapServer(args.host, args.disaggregation_bootstrap_port)
    server.start()
    logger.info("bootstrap server on %s:%d", args.host, server.port)
    return server


def build_kv_manager(args, runner, metadata: MetadataBuffers, tp_rank: int, tp_size: int, role: str,
                     bootstrap_addr: str | None = None) -> KVManager:
    """One KVManager for this rank's share of the KV heads."""
    cfg = runner.model_config
    kv_args = KVArgs.from_pool(runner.kv_pool, metadata, engine_rank=tp_rank, tp_size=tp_size,
                               model=cfg.name, **runner.hybrid.transfer_kwargs())
    return KVManager(kv_args, role, args.transfer_backend, settings=transfer_settings(args),
                     host=advertised_host(args.host), bootstrap_addr=bootstrap_addr)
