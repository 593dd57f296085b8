"""What a prefill or decode node needs from the transfer layer, shared by both roles: the rank's
KV manager (prefill or decode) over the runner's pools, the advertised address, and the transfer
counters it reports."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from transfer.base import KVArgs, TransferSettings
from transfer.manager import KVManager
from transfer.metadata import MetadataBuffers
from transfer.receiver import DecodeKVManager
from transfer.sender import PrefillKVManager

# first-token top logprobs carried from prefill to decode (requests asking for more are refused)
MAX_TOP_LOGPROBS = 20

MANAGERS: dict[str, type[KVManager]] = {"prefill": PrefillKVManager, "decode": DecodeKVManager}


def advertised_host(host: str) -> str:
    """An address peers can reach for a listening host setting ("0.0.0.0" is not one)."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def build_kv_manager(args, runner, metadata: MetadataBuffers, tp_rank: int, tp_size: int, role: str,
                     bootstrap_addr: str | None = None) -> KVManager:
    """The `role`'s KV manager for this rank's share of the KV heads (and hybrid state), with the
    node's timeouts (flags win over the environment); a prefill rank passes its `bootstrap_addr`."""
    kv_args = KVArgs.from_runner(runner, metadata, engine_rank=tp_rank, tp_size=tp_size)
    settings = TransferSettings.from_env(bootstrap_timeout=args.disaggregation_bootstrap_timeout,
                                         waiting_timeout=args.disaggregation_waiting_timeout)
    where = {"bootstrap_addr": bootstrap_addr} if bootstrap_addr else {}
    return MANAGERS[role](kv_args, args.transfer_backend, settings=settings, host=advertised_host(args.host), **where)


@dataclass
class TransferStats:
    failures: int = 0
    successes: int = 0
    bytes: int = 0
    latency_sum: float = 0.0
    latency_last: float = 0.0

    def success(self, nbytes: int, latency: float) -> None:
        self.successes += 1
        self.bytes += nbytes
        self.latency_sum += latency
        self.latency_last = latency

    def as_stats(self) -> dict[str, float]:
        n = self.successes
        return {"transfer_failures": self.failures, "transfer_successes": n, "transfer_bytes": self.bytes,
                "transfer_latency_avg_s": self.latency_sum / n if n else 0.0,
                "transfer_latency_last_s": self.latency_last}


class PDRole:
    """Mixin for a Scheduler subclass that serves one side of a PD pair (`role` "prefill" or
    "decode"; the subclass keeps `self.rooms`, room -> rid, and implements `close()`)."""

    role = "pd"

    def validate_request(self, req):
        if req.bootstrap_host is None or req.bootstrap_port is None or req.bootstrap_room is None:
            return 400, (f"this is a {self.role} node; requests need bootstrap_host/bootstrap_port/"
                         "bootstrap_room (send them through a PD router)")
        if req.bootstrap_room in self.rooms:
            return 400, f"bootstrap_room {req.bootstrap_room} is already in use by request {self.rooms[req.bootstrap_room]}"
        if req.top_logprobs_num > MAX_TOP_LOGPROBS:
            return 400, f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS} on a PD cluster, got {req.top_logprobs_num}"
        # then the scheduler's own checks, with the client's max_new_tokens, so both legs agree
        return super().validate_request(req)

    def event_loop(self) -> None:
        try:
            super().event_loop()
        finally:
            self.close()
