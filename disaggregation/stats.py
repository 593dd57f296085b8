"""The transfer counters a PD node reports (`/server_info`, `/metrics`).

Each request counts once per node: in `successes`, or in `failures`, or in `aborts`.

* `failures`: every request whose transfer failed on this node, ended by the role's poll (`PDRole.fail`)
  or ended another way while its sender/receiver had already failed here (an abort that arrived in
  the same iteration as the failure, say the router's abort of the decode leg after the prefill leg
  failed: `PDRole.release_conn`). `failures_bootstrap` counts those of them that failed before any
  KV moved (rendezvous, `TransferInfo`, preallocation).
* `aborts`: transfers this node gave up while they were still healthy (a client or router abort, a
  request refused or ended for another reason).
* `successes`, with the bytes moved and the latency of each (its histogram, sum and last value).

`guard` adds the control and bootstrap planes' own counters (dropped messages by cause, refused
registrations, open sockets) to the report; `PDRole.pd_stats` adds the open PD requests and the
manager's `rejected_peer_values` (peer messages refused by a check, transfer/peer_checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.histogram import BucketCounts


@dataclass
class TransferStats:
    failures: int = 0
    failures_bootstrap: int = 0  # of `failures`: before any KV moved (rendezvous, TransferInfo, prealloc)
    aborts: int = 0
    successes: int = 0
    bytes: int = 0
    latency_sum: float = 0.0
    latency_last: float = 0.0
    # the planes' guard counters (dropped messages by cause, refused registrations, open sockets)
    guard: Callable[[], dict[str, int]] | None = field(default=None, repr=False, compare=False)

    latency_hist: BucketCounts = field(default_factory=BucketCounts, repr=False, compare=False)

    def success(self, nbytes: int, latency: float) -> None:
        self.successes += 1
        self.bytes += nbytes
        self.latency_sum += latency
        self.latency_last = latency
        self.latency_hist.observe(latency)

    def failure(self, before_transfer: bool) -> None:
        """One more failed transfer; `before_transfer`: no KV had moved yet."""
        self.failures += 1
        if before_transfer:
            self.failures_bootstrap += 1

    def as_stats(self) -> dict[str, float]:
        n = self.successes
        return {"transfer_failures": self.failures, "transfer_failures_bootstrap": self.failures_bootstrap,
                "transfer_aborts": self.aborts, "transfer_successes": n,
                "transfer_latency_hist": self.latency_hist.as_stats(),
                "transfer_bytes": self.bytes,
                "transfer_latency_avg_s": self.latency_sum / n if n else 0.0,
                "transfer_latency_last_s": self.latency_last, **(self.guard() if self.guard else {})}
