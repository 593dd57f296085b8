"""A node's Prometheus metrics, through `prometheus_client` (one registry per front end process).

Names follow SGLang's (`sglang:*`, every series labelled `model_name`), so SGLang's Grafana dashboard and
tools that read SGLang's metrics (llm-d's scorers, Dynamo) work unchanged; what SGLang has no name for is
`pdserve_*`. The front end counts and times requests as they finish; the scheduler's figures (queues, KV
use, transfers, the cluster planes' guards) come with its stats, fetched on every scrape, and are turned
into metric families by `_StatsCollector` at that moment.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# scheduler stats with SGLang's names: sglang name -> (stats key, help)
SGLANG_GAUGES = {
    "sglang:num_running_reqs": ("num_running_reqs", "requests in the running batch"),
    "sglang:num_queue_reqs": ("num_queued_reqs", "requests waiting to run (every queue of the node)"),
    "sglang:num_used_tokens": ("num_tokens_used", "KV tokens in use"),
    "sglang:max_total_num_tokens": ("kv_total_tokens", "KV cache size in tokens"),
    "sglang:cache_hit_rate": ("cache_hit_rate", "share of prompt tokens served from the prefix cache"),
    "sglang:gen_throughput": ("gen_throughput", "decode throughput (tokens/s, last 10 s)"),
    "sglang:max_running_requests": ("max_running_requests", "most requests in the running batch"),
    "sglang:spec_accept_length": ("spec_accept_length", "speculative decoding: tokens a request gets per "
                                                        "verify forward, since start (1: no draft accepted)"),
}

# scheduler stats without an SGLang name: pdserve_<key>; "counter" ones only grow
STAT_METRICS = {
    "kv_free_tokens": ("gauge", "free KV cache slots (tokens)"),
    "kv_evictable_tokens": ("gauge", "KV tokens held only by the radix cache (evictable)"),
    "req_slots_free": ("gauge", "free request slots"),
    "req_slots_total": ("gauge", "request slots"),
    "num_retractions": ("counter", "decode requests retracted when KV memory ran out"),
    "spec_verify_steps": ("counter", "speculative decoding: forwards that verified drafts"),
    "spec_draft_tokens": ("counter", "speculative decoding: draft tokens proposed"),
    "spec_accepted_tokens": ("counter", "speculative decoding: draft tokens the model confirmed"),
    "num_overlapped_steps": ("counter", "decode steps built while the step before was still computing "
                                        "(overlap scheduling)"),
    "num_mixed_steps": ("counter", "prefill forwards the running requests decoded in (--enable-mixed-chunk)"),
    "num_prealloc_tokens": ("gauge", "decode: KV tokens preallocated for requests still being transferred"),
    "metadata_slots_free": ("gauge", "free MetadataBuffers slots"),
    "metadata_slots_total": ("gauge", "MetadataBuffers slots"),
    "prealloc_slots_free": ("gauge", "decode: free request rows of the preallocation budget"),
    "prealloc_slots_total": ("gauge", "decode: request rows of the preallocation budget"),
    "req_rows_free": ("gauge", "free request rows (req-to-token rows, running and preallocated)"),
    "req_rows_total": ("gauge", "request rows (req-to-token rows, running and preallocated)"),
    "kv_quarantined_pages": ("gauge",
                             "decode: KV pages of failed rooms held until their prefill ranks stop writing"),
    "kv_quarantined_rooms": ("gauge",
                             "decode: failed rooms whose memory is held until their prefill ranks stop"),
    "core_loan_idle_seconds": ("counter", "prefill, lending its cores (--core-loan-file): seconds it had no "
                                          "forward to run, its cores lent to its decode node"),
    "core_loan_forwards": ("counter", "decode, borrowing (--core-loan-cores): forwards run"),
    "core_loan_lent_forwards": ("counter", "decode, borrowing (--core-loan-cores): forwards run with threads "
                                           "on the prefill node's idle cores too"),
    "core_loan_contended_forwards": ("counter", "decode, borrowing: lent forwards the prefill node woke up "
                                                "during (they shared its cores until they ended)"),
    "num_local_prefills": ("counter", "decode: requests without a PD rendezvous prefilled on this node "
                                      "(--disaggregation-local-prefill)"),
    "pd_requests_open": ("gauge", "requests the PD role tracks (bootstrap, transfer, inflight or waiting)"),
    "transfer_rooms_open": ("gauge", "transfer rooms (senders or receivers) not ended yet"),
    "transfer_rooms_draining": ("gauge",
                                "failed rooms waiting for their last write (prefill) or AbortAck (decode)"),
    "transfer_rooms_pending_info": ("gauge", "prefill: rooms with a TransferInfo and no sender yet"),
    "transfer_early_aborts": ("gauge", "prefill: Aborts recorded before their room's TransferInfo"),
    "transfer_peers_registered": ("gauge", "peer ranks registered (prefill: decode RegisterPeers; decode: "
                                           "prefill ranks told)"),
    "transfer_peers_watched": ("gauge", "peer ranks under heartbeat watch"),
    "transfer_engine_peers": ("gauge", "peers added to the transfer engine"),
    "transfer_paused_seconds": ("counter", "seconds the heartbeat timer did not run beyond one interval "
                                           "(process paused or starved); peers' silence over them is "
                                           "not counted"),
    "transfer_aborts": ("counter", "KV transfers aborted (the request ended before its transfer did)"),
    "control_registrations_expired": ("counter",
                                      "registered peers without rooms dropped after missing heartbeats"),
    "control_dropped_unauthenticated": ("counter", "control-plane frames without a valid MAC, dropped"),
    "control_dropped_stale_or_replayed": ("counter",
                                          "control-plane frames outside the time window or replayed"),
    "control_dropped_oversized": ("counter", "control-plane frames over the size limit, dropped"),
    "control_dropped_undecodable": ("counter", "control-plane frames that did not decode, dropped"),
    "control_send_failures": ("counter", "control-plane sends that could not be queued"),
    "control_peers_open": ("gauge", "control-plane sockets open to peers"),
    "control_peers_evicted": ("counter", "control-plane sockets closed as least recently used"),
    "control_pings_ignored": ("counter", "pings from unknown senders left unanswered"),
    "control_registrations_refused": ("counter", "RegisterPeers refused (would redirect a peer's live rooms, "
                                                 "or every registered decode rank has rooms)"),
    "control_registrations_evicted": ("counter", "idle decode registrations dropped for new ones"),
    "bootstrap_dropped_unauthenticated": ("counter", "bootstrap requests without a valid MAC (401)"),
    "bootstrap_dropped_stale_or_replayed": ("counter",
                                            "bootstrap requests outside the time window or replayed (401)"),
    "bootstrap_dropped_oversized": ("counter", "bootstrap requests over the body limit (413)"),
    "bootstrap_dropped_undecodable": ("counter",
                                      "bootstrap requests with undecodable bodies or fields (400)"),
    "bootstrap_registrations_refused": ("counter",
                                        "registrations refused: the rank is alive elsewhere (409)"),
    "bootstrap_registrations_replaced": ("counter", "registrations that replaced a dead rank's address"),
    "moe_eplb_rebalances": ("counter", "EPLB rebalances over all MoE layers"),
}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _histogram(name: str, help: str, model: str, h: Any) -> HistogramMetricFamily | None:
    """A histogram family from `common.histogram.BucketCounts.as_stats()`."""
    if not isinstance(h, dict) or not all(k in h for k in ("buckets", "counts", "sum")):
        return None
    acc, buckets = 0, []
    for le, n in zip([*h["buckets"], float("inf")], h["counts"], strict=False):
        acc += n
        buckets.append(("+Inf" if le == float("inf") else repr(float(le)), acc))
    fam = HistogramMetricFamily(name, help, labels=["model_name"])
    fam.add_metric([model], buckets, sum_value=h["sum"])
    return fam


class _StatsCollector:
    """The scheduler's last stats as metric families, at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # families depend on the node's role: nothing to register ahead

    def collect(self):
        stats, model = self.metrics.stats, self.metrics.model_name
        yield _gauge("pdserve_healthy", "1 while every scheduler process is alive", model,
                     self.metrics.healthy.value)
        if not stats:
            return
        for name, (key, help) in SGLANG_GAUGES.items():
            if _number(stats.get(key)):
                yield _gauge(name, help, model, stats[key])
        used, total = stats.get("num_tokens_used"), stats.get("kv_total_tokens")
        if _number(used) and _number(total) and total:
            yield _gauge("sglang:token_usage", "share of the KV cache in use", model, used / total)
        queues = stats.get("num_queue_reqs")
        if isinstance(queues, dict):
            fam = GaugeMetricFamily("pdserve_queue_reqs", "requests per queue of the node (PD stages on a "
                                    "prefill or decode node)", labels=["model_name", "queue"])
            for q, v in sorted(queues.items()):
                if _number(v):
                    fam.add_metric([model, str(q)], v)
            yield fam
        for key, (kind, help) in STAT_METRICS.items():
            v = stats.get(key)
            if not _number(v):
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = family("pdserve_" + key, help, labels=["model_name"])
            fam.add_metric([model], v)
            yield fam
        if _number(stats.get("transfer_bytes")):
            fam = CounterMetricFamily("pdserve_kv_transfer_bytes", "KV (and state) bytes sent or received",
                                      labels=["model_name"])
            fam.add_metric([model], stats["transfer_bytes"])
            yield fam
        if _number(stats.get("transfer_failures")):
            boot = stats.get("transfer_failures_bootstrap", 0)
            fam = CounterMetricFamily("pdserve_kv_transfer_failures", "failed KV transfers by cause: "
                                      "bootstrap (before any KV moved) or transfer",
                                      labels=["model_name", "cause"])
            fam.add_metric([model, "bootstrap"], boot)
            fam.add_metric([model, "transfer"], stats["transfer_failures"] - boot)
            yield fam
        yield from _expert_families(stats, model)
        for name, key, help in (("pdserve_kv_transfer_latency_seconds", "transfer_latency_hist",
                                 "time from a room's first KV write to its Success"),
                                ("pdserve_queue_time_seconds", "queue_time_hist",
                                 "time from a request's arrival to its first prefill step (every queue "
                                 "included)")):
            fam = _histogram(name, help, model, stats.get(key))
            if fam is not None:
                yield fam


def _expert_families(stats: dict[str, Any], model: str):
    """A mixture-of-experts model's routing: pairs per expert (summed over layers) and each layer's
    imbalance (its busiest expert's pairs over the mean)."""
    loads = stats.get("moe_expert_load")
    if not isinstance(loads, dict) or not loads:
        return
    total = CounterMetricFamily("pdserve_moe_expert_tokens", "(token, choice) pairs routed to each expert, "
                                "summed over the MoE layers", labels=["model_name", "expert"])
    per_expert: dict[int, int] = {}
    skew = GaugeMetricFamily("pdserve_moe_expert_load_imbalance", "busiest expert's pairs over the mean, per "
                             "MoE layer (1: even)", labels=["model_name", "layer"])
    for layer, counts in loads.items():
        for e, n in enumerate(counts):
            per_expert[e] = per_expert.get(e, 0) + n
        mean = sum(counts) / len(counts) if counts else 0
        skew.add_metric([model, str(layer)], max(counts) / mean if mean else 1.0)
    for e, n in sorted(per_expert.items()):
        total.add_metric([model, str(e)], n)
    yield total
    yield skew


def _gauge(name: str, help: str, model: str, value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, help, labels=["model_name"])
    fam.add_metric([model], value)
    return fam


class _Bound:
    """A labelled metric with `model_name` filled in: `inc(amount, **labels)` / `observe(v)` / `set(v)`."""

    def __init__(self, metrics: Metrics, metric) -> None:
        self._m, self._metric = metrics, metric

    def _child(self, labels):
        return self._metric.labels(model_name=self._m.model_name, **labels)

    def inc(self, amount: float = 1.0, **labels) -> None:
        self._child(labels).inc(amount)

    def observe(self, value: float, **labels) -> None:
        self._child(labels).observe(value)

    def set(self, value: float, **labels) -> None:
        self._child(labels).set(value)


class _Value:
    """A gauge's value, exported by the stats collector with the model name known at scrape time."""

    def __init__(self, value: float) -> None:
        self.value = value

    def set(self, value: float) -> None:
        self.value = value


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # the served model name (set by the app)
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats: dict[str, Any] = {}
        self._lock = threading.Lock()
        r, mn = self.registry, ["model_name"]

        def counter(name, help, labels=()):
            return _Bound(self, Counter(name, help, [*mn, *labels], registry=r))

        def histogram(name, help, buckets):
            return _Bound(self, Histogram(name, help, mn, registry=r, buckets=buckets))

        self.prompt_tokens = counter("sglang:prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("sglang:generation_tokens", "generated tokens of finished requests")
        self.cached_tokens = counter("sglang:cached_tokens", "prompt tokens served from the prefix cache")
        self.requests = counter("pdserve_requests", "finished HTTP requests by endpoint and status",
                                ("endpoint", "status"))
        self.aborted = counter("pdserve_aborted_requests",
                               "requests aborted (client gone, abort_request, error)")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "time from arrival to the first token",
                              LATENCY_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "time from arrival to the last token",
                             LATENCY_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "time between two output tokens", ITL_BUCKETS)
        self.tpot = histogram("sglang:time_per_output_token_seconds", "a request's decode time per output "
                              "token after the first", ITL_BUCKETS)
        self.healthy = _Value(1)
        self.registry.register(_StatsCollector(self))

    def set_stats(self, stats: dict[str, Any]) -> None:
        with self._lock:
            self.stats = dict(stats)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
