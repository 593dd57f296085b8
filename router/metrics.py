"""Prometheus text exposition of the router's counters, latency histogram and worker states."""

from __future__ import annotations

import bisect
import collections

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_CB_STATE = {"closed": 0, "half_open": 1, "open": 2}


class Metrics:
    def __init__(self):
        self.requests: collections.Counter = collections.Counter()  # (route, status)
        self.hist: dict[str, list[int]] = {}
        self.hist_sum: collections.Counter = collections.Counter()
        self.retries = 0
        self.orphan_aborts = 0
        self.client_disconnects = 0
        self.stream_errors = 0
        self.overload_passed = 0  # workers' 429/503 answers given to the client as they were
        self.admission = None  # router.limits.Admission, set by the app
        self.kv_index = None  # router.kv_index.KVEventIndex with --kv-events
        self.route_counts = None  # the exact cache_aware policy's decisions by kind

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        h = self.hist.get(route)
        if h is None:
            h = self.hist[route] = [0] * (len(BUCKETS) + 1)
        h[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.hist_sum[route] += seconds

    def render(self, workers) -> str:
        out = ["# TYPE pdserve_router_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            out.append(f'pdserve_router_requests_total{{route="{route}",status="{status}"}} {n}')
        out.append("# TYPE pdserve_router_request_duration_seconds histogram")
        for route, h in sorted(self.hist.items()):
            acc = 0
            for le, n in zip(BUCKETS, h, strict=False):
                acc += n
                out.append(f'pdserve_router_request_duration_seconds_bucket{{route="{route}",le="{le}"}} {acc}')
            acc += h[-1]
            out.append(f'pdserve_router_request_duration_seconds_bucket{{route="{route}",le="+Inf"}} {acc}')
            out.append(f'pdserve_router_request_duration_seconds_sum{{route="{route}"}} {self.hist_sum[route]:.6f}')
            out.append(f'pdserve_router_request_duration_seconds_count{{route="{route}"}} {acc}')
        for name, value in (("retries_total", self.retries), ("orphan_aborts_total", self.orphan_aborts),
                            ("client_disconnects_total", self.client_disconnects),
                            ("stream_errors_total", self.stream_errors)):
            out.append(f"# TYPE pdserve_router_{name} counter")
            out.append(f"pdserve_router_{name} {value}")
        out.append("# TYPE pdserve_router_worker_overload_answers_total counter")
        out.append(f"pdserve_router_worker_overload_answers_total {self.overload_passed}")
        adm = self.admission
        if adm is not None:
            out.append("# TYPE pdserve_router_in_flight_requests gauge")
            out.append(f"pdserve_router_in_flight_requests {adm.in_flight}")
            out.append("# TYPE pdserve_router_queued_requests gauge")
            out.append(f"pdserve_router_queued_requests {adm.queued}")
            out.append("# TYPE pdserve_router_rejected_requests_total counter")
            for reason in ("concurrency", "queue_full", "queue_timeout", "rate_limit", "payload_too_large"):
                out.append(f'pdserve_router_rejected_requests_total{{reason="{reason}"}} {adm.rejected[reason]}')
        if self.kv_index is not None:
            out.append("# TYPE pdserve_router_kv_event_blocks gauge")
            views = list(self.kv_index.views.values())
            for v in views:
                out.append(f'pdserve_router_kv_event_blocks{{worker="{v.url}"}} {len(v.blocks)}')
            out.append("# TYPE pdserve_router_kv_events_total counter")
            for kind in (list(views[0].counters) if views else []):  # the same kinds on every view
                for v in views:
                    out.append(f'pdserve_router_kv_events_total{{worker="{v.url}",kind="{kind}"}} '
                               f'{v.counters[kind]}')
        if self.route_counts is not None:
            out.append("# TYPE pdserve_router_prefill_routes_total counter")
            for kind, n in self.route_counts.items():
                out.append(f'pdserve_router_prefill_routes_total{{by="{kind}"}} {n}')
        gauges = (("worker_healthy", lambda w: int(w.healthy)), ("worker_active_requests", lambda w: w.active),
                  ("worker_circuit_state", lambda w: _CB_STATE[w.breaker.state]),
                  ("worker_requests_total", lambda w: w.requests), ("worker_errors_total", lambda w: w.errors),
                  ("worker_load", lambda w: -1 if w.load is None else w.load))
        for name, fn in gauges:
            out.append(f"# TYPE pdserve_router_{name} gauge")
            for w in workers:
                out.append(f'pdserve_router_{name}{{worker="{w.url}",type="{w.kind}"}} {fn(w)}')
        return "\n".join(out) + "\n"
