"""Prometheus metrics of a node's front end, rendered in the text exposition format (version 0.0.4).

Counters and histograms are updated by the tokenizer manager as requests finish; gauges are filled
from the scheduler's stats (`StatsReport`) each time `/metrics` is scraped.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any

PREFIX = "pdserve_"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()):
        self.name = PREFIX + name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help, labelnames=()):
        super().__init__(name, help, labelnames)
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(str(labels[n]) for n in self.labelnames)
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        lines = self.header()
        for key, v in sorted(self.values.items()):
            lines.append(f"{self.name}_total{_labels(self.labelnames, key)} {_fmt(v)}")
        return lines


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name, help, labelnames=()):
        super().__init__(name, help, labelnames)
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, **labels: str) -> None:
        key = tuple(str(labels[n]) for n in self.labelnames)
        with self._lock:
            self.values[key] = float(value)

    def render(self) -> list[str]:
        lines = self.header()
        for key, v in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.labelnames, key)} {_fmt(v)}")
        return lines


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help, buckets=LATENCY_BUCKETS):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self.counts[i] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        lines = self.header()
        acc = 0
        for b, c in zip((*self.buckets, math.inf), self.counts, strict=True):
            acc += c
            lines.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {acc}')
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


# scheduler stats exported as gauges: stats key -> help
STAT_GAUGES = {
    "num_running_reqs": "requests in the running batch",
    "num_waiting_reqs": "requests waiting to be scheduled",
    "kv_free_tokens": "free KV cache slots (tokens)",
    "kv_total_tokens": "KV cache size (tokens)",
    "kv_evictable_tokens": "KV tokens held only by the radix cache (evictable)",
    "req_slots_free": "free request slots",
    "req_slots_total": "request slots",
    "cache_hit_rate": "share of prompt tokens served from the prefix cache",
    "num_tokens_used": "KV tokens in use",
    "gen_throughput": "decode throughput (tokens/s)",
    # PD roles (absent on a colocated node)
    "num_prealloc_tokens": "decode: KV tokens preallocated for requests still being transferred",
    "metadata_slots_free": "free MetadataBuffers slots",
    "metadata_slots_total": "MetadataBuffers slots",
    "prealloc_slots_free": "decode: free request rows of the preallocation budget",
    "prealloc_slots_total": "decode: request rows of the preallocation budget",
    "req_rows_free": "free request rows (req-to-token rows, running and preallocated)",
    "req_rows_total": "request rows (req-to-token rows, running and preallocated)",
    "kv_quarantined_pages": "decode: KV pages of failed rooms held until their prefill ranks stop writing",
    "kv_quarantined_rooms": "decode: failed rooms whose memory is held until their prefill ranks stop writing",
    "pd_requests_open": "requests the PD role tracks (bootstrap, transfer, inflight or waiting)",
    "transfer_rooms_open": "transfer rooms (senders or receivers) not ended yet",
    "transfer_rooms_draining": "failed rooms waiting for their last write to end (prefill) or AbortAck (decode)",
    "transfer_rooms_pending_info": "prefill: rooms with a TransferInfo and no sender yet",
    "transfer_early_aborts": "prefill: Aborts recorded before their room's TransferInfo",
    "transfer_peers_registered": "peer ranks registered (prefill: decode RegisterPeers; decode: prefill ranks told)",
    "transfer_peers_watched": "peer ranks under heartbeat watch",
    "transfer_engine_peers": "peers added to the transfer engine",
    "control_registrations_expired": "registered peers without rooms dropped after missing heartbeats (counter)",
    "transfer_failures": "KV transfers that failed (counter)",
    "transfer_bytes": "KV bytes sent or received (counter)",
    "transfer_latency_avg_s": "mean KV transfer latency (seconds)",
    "transfer_latency_last_s": "latest KV transfer latency (seconds)",
    # the cluster planes' guards (rank 0; the bootstrap ones on a prefill node)
    "control_dropped_unauthenticated": "control-plane frames without a valid MAC, dropped (counter)",
    "control_dropped_stale_or_replayed": "control-plane frames outside the time window or replayed, dropped (counter)",
    "control_dropped_oversized": "control-plane frames over the size limit, dropped (counter)",
    "control_dropped_undecodable": "control-plane frames that did not decode, dropped (counter)",
    "control_send_failures": "control-plane sends that could not be queued (counter)",
    "control_peers_open": "control-plane sockets open to peers",
    "control_peers_evicted": "control-plane sockets closed as least recently used (counter)",
    "control_pings_ignored": "pings from unknown senders left unanswered (counter)",
    "control_registrations_refused": "RegisterPeers refused: would redirect a peer's live rooms, or every "
                                     "registered decode rank has rooms (counter)",
    "control_registrations_evicted": "idle decode registrations dropped for new ones, PDSERVE_MAX_DECODE_PEERS (counter)",
    "bootstrap_dropped_unauthenticated": "bootstrap requests without a valid MAC, 401 (counter)",
    "bootstrap_dropped_stale_or_replayed": "bootstrap requests outside the time window or replayed, 401 (counter)",
    "bootstrap_dropped_oversized": "bootstrap requests over the body limit, 413 (counter)",
    "bootstrap_dropped_undecodable": "bootstrap requests with undecodable bodies or fields, 400 (counter)",
    "bootstrap_registrations_refused": "registrations refused: the rank is alive elsewhere, 409 (counter)",
    "bootstrap_registrations_replaced": "registrations that replaced a dead rank's address (counter)",
}


class Metrics:
    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.requests = Counter("requests", "finished HTTP requests by endpoint and status",
                                ("endpoint", "status"))
        self.prompt_tokens = Counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = Counter("generation_tokens", "generated tokens of finished requests")
        self.cached_tokens = Counter("cached_tokens", "prompt tokens served from the prefix cache")
        self.aborted = Counter("aborted_requests", "requests aborted (client gone, abort_request, error)")
        self.ttft = Histogram("time_to_first_token_seconds", "time from arrival to the first token")
        self.e2e = Histogram("e2e_request_latency_seconds", "time from arrival to the last token")
        self.itl = Histogram("inter_token_latency_seconds", "time between two output tokens", ITL_BUCKETS)
        self.healthy = Gauge("healthy", "1 while every scheduler process is alive")
        self.stat_gauges = {k: Gauge(k, h) for k, h in STAT_GAUGES.items()}
        self.queue_gauge = Gauge("num_queue_reqs", "requests per scheduler queue", ("queue",))
        self.healthy.set(1)

    def set_stats(self, stats: dict[str, Any]) -> None:
        for k, g in self.stat_gauges.items():
            v = stats.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                g.set(v)
        queues = stats.get("num_queue_reqs")
        if isinstance(queues, dict):
            for q, v in queues.items():
                if isinstance(v, (int, float)):
                    self.queue_gauge.set(v, queue=q)

    def render(self) -> str:
        lines: list[str] = []
        for m in (self.requests, self.prompt_tokens, self.generation_tokens, self.cached_tokens, self.aborted,
                  self.ttft, self.e2e, self.itl, self.healthy, *self.stat_gauges.values(), self.queue_gauge):
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
