"""The router's Prometheus metrics, rendered by `prometheus_client` from its counters at scrape time.

Names and labels follow sglang-router's (`smg_http_*`, `smg_worker_*`, as the pinned sglang-router 0.3.2
exports them), so what reads sglang-router's metrics reads these; what it has no name for is
`pdserve_router_*`. Every family has HELP and TYPE lines; counters are counters.
"""

from __future__ import annotations

import bisect
import collections
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# smg_worker_cb_state: 0 closed, 1 half-open (trial requests), 2 open (no traffic)
_CB_STATE = {"closed": 0, "half_open": 1, "open": 2}
REJECT_REASONS = ("concurrency", "queue_full", "queue_timeout", "rate_limit", "payload_too_large")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WINDOW_SECONDS = 60.0  # the dashboard's latency percentiles


def _family(kind, name, help, labels, rows):
    fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help, labels=list(labels))
    for values, v in rows:
        fam.add_metric([str(x) for x in values], v)
    return fam


class LatencyWindow:
    """(time, TTFT, TPOT) of recent streamed requests, for percentiles over the last minute."""

    def __init__(self, maxlen: int = 4096) -> None:
        self.samples: collections.deque = collections.deque(maxlen=maxlen)

    def add(self, ttft: float, tpot: float | None) -> None:
        self.samples.append((time.monotonic(), ttft, tpot))

    def percentiles(self) -> dict:
        return {"window_s": WINDOW_SECONDS, **self.percentiles_since(time.monotonic() - WINDOW_SECONDS)}

    def percentiles_since(self, cutoff: float) -> dict:
        """`n`, `ttft` and `tpot` quantiles of the samples taken at or after `cutoff` (time.monotonic());
        the SLO planner's window (router/planner.py)."""
        recent = [s for s in self.samples if s[0] >= cutoff]
        return {"n": len(recent), "ttft": _quantiles([s[1] for s in recent]),
                "tpot": _quantiles([s[2] for s in recent if s[2] is not None])}


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    v = sorted(values)
    return {f"p{q}": v[min(len(v) - 1, int(q / 100 * len(v)))] for q in (50, 90, 99)}


class Metrics:
    def __init__(self):
        self.requests: collections.Counter = collections.Counter()  # (route, status)
        self.hist: dict[str, list[int]] = {}
        self.hist_sum: collections.Counter = collections.Counter()
        self.retries = 0
        self.orphan_aborts = 0
        self.client_disconnects = 0
        self.stream_errors = 0
        self.reruns_before_first_token = 0  # streams whose decode failed before a token reached the client
        self.silent_workers = 0  # workers taken out of rotation for going silent (router/liveness.py)
        self.decodes_full = 0  # requests answered 429 because every decode was full (router/capacity.py)
        self.overload_passed = 0  # workers' 429/503 answers given to the client as they were
        self.admission = None  # router.limits.Admission, set by the app
        self.kv_index = None  # router.kv_index.KVEventIndex with --kv-events
        self.route_counts = None  # the exact cache_aware policy's decisions by kind
        self.latency = LatencyWindow()  # streamed requests' TTFT and TPOT (the dashboard)
        self.policies: dict[str, str] = {}  # worker type -> its policy's name (smg_worker_selection_total)

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        h = self.hist.get(route)
        if h is None:
            h = self.hist[route] = [0] * (len(BUCKETS) + 1)
        h[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.hist_sum[route] += seconds

    def render(self, workers) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, list(workers)))
        return generate_latest(registry).decode()


class _Collector:
    def __init__(self, m: Metrics, workers) -> None:
        self.m, self.workers = m, workers

    def describe(self):
        return []

    def collect(self):
        m, ws = self.m, self.workers
        by_route: collections.Counter = collections.Counter()
        by_status: collections.Counter = collections.Counter()
        for (route, status), n in m.requests.items():
            by_route[route] += n
            by_status[status] += n
        yield _family("counter", "smg_http_requests", "generation requests received", ("method", "path"),
                      [(("POST", r), n) for r, n in sorted(by_route.items())])
        yield _family("counter", "smg_http_responses", "generation answers by status",
                      ("status_code", "error_code"), [((s, ""), n) for s, n in sorted(by_status.items())])
        hist = HistogramMetricFamily("smg_http_request_duration_seconds", "time from a request's arrival to "
                                     "the end of its answer (stream included)", labels=["method", "path"])
        for route, h in sorted(m.hist.items()):
            acc, buckets = 0, []
            for le, n in zip((*BUCKETS, float("inf")), h, strict=True):
                acc += n
                buckets.append(("+Inf" if le == float("inf") else repr(le), acc))
            hist.add_metric(["POST", route], buckets, sum_value=m.hist_sum[route])
        yield hist
        yield _family("gauge", "smg_worker_health",
                      "1 while the worker passes its health checks", ("worker",),
                      [((w.url,), int(w.healthy)) for w in ws])
        yield _family("gauge", "smg_worker_cb_state",
                      "circuit breaker: 0 closed, 1 half-open, 2 open", ("worker",),
                      [((w.url,), _CB_STATE[w.breaker.state]) for w in ws])
        yield _family("gauge", "smg_worker_requests_active",
                      "requests in flight on the worker through this router",
                      ("worker",), [((w.url,), w.active) for w in ws])
        pools: collections.Counter = collections.Counter()
        selections: collections.Counter = collections.Counter()
        for w in ws:
            model = w.model_info.get("model_path") or "default"
            pools[(w.kind, "http", model)] += 1
            selections[(w.kind, "http", model, m.policies.get(w.kind, ""))] += w.requests
        yield _family("gauge", "smg_worker_pool_size", "registered workers",
                      ("worker_type", "connection_mode", "model"), sorted(pools.items()))
        yield _family("counter", "smg_worker_selection", "legs sent to workers",
                      ("worker_type", "connection_mode", "model", "policy"), sorted(selections.items()))
        yield _family("counter", "pdserve_router_worker_errors", "legs that failed on the worker (5xx or "
                      "broken connection; overload answers not counted)", ("worker", "type"),
                      [((w.url, w.kind), w.errors) for w in ws])
        yield _family("counter", "pdserve_router_local_prefills", "requests sent to a decode worker alone, "
                      "to prefill there (--local-prefill-queue)", ("worker",),
                      [((w.url,), w.local_prefills) for w in ws if w.kind == "decode"])
        yield _family("counter", "pdserve_router_local_prefill_refusals", "of those, requests the decode "
                      "worker refused as longer than it prefills itself, then sent with "
                      "both legs", ("worker",),
                      [((w.url,), w.local_refused) for w in ws if w.kind == "decode"])
        yield _family("gauge", "pdserve_router_worker_load",
                      "the worker's /get_load tokens (power_of_two; -1 unknown)",
                      ("worker", "type"), [((w.url, w.kind), -1 if w.load is None else w.load) for w in ws])
        for name, value, help in (
                ("retries", m.retries, "attempts after the first"),
                ("orphan_aborts", m.orphan_aborts, "abandoned legs aborted on their node"),
                ("client_disconnects", m.client_disconnects, "clients gone before their answer ended"),
                ("stream_errors", m.stream_errors, "streams broken by a failed leg"),
                ("reruns_before_first_token", m.reruns_before_first_token,
                 "streams whose decode failed before their first token, run again on another pair"),
                ("decodes_full_answers", m.decodes_full, "requests answered 429 because every decode worker "
                 "was full"),
                ("silent_workers", m.silent_workers, "times a worker was taken out of rotation for going "
                 "silent (--worker-silence-timeout-secs)"),
                ("worker_overload_answers", m.overload_passed,
                 "workers' 429/503 answers passed to the client")):
            yield _family("counter", f"pdserve_router_{name}", help, (), [((), value)])
        adm = m.admission
        if adm is not None:
            yield _family("gauge", "pdserve_router_in_flight_requests", "admitted requests not ended yet", (),
                          [((), adm.in_flight)])
            yield _family("gauge", "pdserve_router_queued_requests", "requests waiting for admission", (),
                          [((), adm.queued)])
            yield _family("counter", "pdserve_router_rejected_requests",
                          "requests refused by the router's limits",
                          ("reason",), [((r,), adm.rejected[r]) for r in REJECT_REASONS])
        if m.kv_index is not None:
            views = list(m.kv_index.views.values())
            yield _family("gauge", "pdserve_router_kv_event_blocks",
                          "blocks the router knows a worker caches",
                          ("worker",), [((v.key,), len(v.blocks)) for v in views])
            kinds = list(views[0].counters) if views else []  # the same kinds on every view
            yield _family("counter", "pdserve_router_kv_events", "KV events received", ("worker", "kind"),
                          [((v.key, k), v.counters[k]) for k in kinds for v in views])
        if m.route_counts is not None:
            yield _family("counter", "pdserve_router_prefill_routes", "prefill choices of the exact "
                          "cache_aware policy", ("by",), [((k,), n) for k, n in m.route_counts.items()])
