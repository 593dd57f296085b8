"""OpenTelemetry tracing (`--enable-trace`, `--otlp-traces-endpoint`): one trace per request across the
router, the prefill node and the decode node.

The router opens a request's root span (a child of the client's W3C `traceparent` when it sent one) and
passes its context to both legs in the `traceparent` header. A node's front end opens a span per request
under it and hands its context to the scheduler in `TokenizedRequest.traceparent`; the scheduler records
when the request entered each stage (`Req.mark`) and, when the request is released, writes one span per
stage (bootstrap, waiting, prefill, transfer, decode, ...) with those times. The decode node's TransferInfo
carries the traceparent of its request to the prefill node, whose transfer span links to it.

Spans go to an OTLP/HTTP collector (protobuf, the collector's port 4318) in batches from a background
thread. Torch-free: the router imports it. Without `--enable-trace` nothing here is imported at all.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
# the client's trace context of the HTTP request being handled (set by the node's middleware)
incoming_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("traceparent", default=None)


def otlp_traces_url(endpoint: str) -> str:
    """`host:port`, `http://host:port` or a full URL → the OTLP/HTTP traces URL (`.../v1/traces`)."""
    url = endpoint if "://" in endpoint else "http://" + endpoint
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be HOST:PORT or an http(s) URL, got {endpoint!r}")
    return url if parts.path not in ("", "/") else url.rstrip("/") + "/v1/traces"


def check_available() -> str | None:
    """Why tracing cannot be turned on here, or None."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        return (f"--enable-trace needs the OpenTelemetry SDK and OTLP/HTTP exporter ({e}); "
                "pip install 'pdserve[trace]'")
    return None


def service_name(disaggregation_mode: str) -> str:
    """A node's service name in traces: pdserve-prefill, pdserve-decode, or pdserve (colocated)."""
    return "pdserve" if disaggregation_mode in ("null", "", None) else f"pdserve-{disaggregation_mode}"


def _ns(t: float) -> int:
    return int(t * 1e9)


class Tracer:
    """The spans of one process (service `service_name`), exported to `endpoint` in batches."""

    def __init__(self, service_name: str, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.url = otlp_traces_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url, timeout=5),
                                                            schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        logger.info("tracing: spans of %s go to %s", service_name, self.url)

    # --------------------------------------------------------------------------- context
    def context_of(self, traceparent: str | None):
        """The parent context a W3C traceparent names (None: a new trace); a malformed one is ignored,
        as the W3C rules say."""
        if not traceparent:
            return None
        return self._propagator.extract({TRACEPARENT: traceparent}) or None

    def traceparent_of(self, span) -> str | None:
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT)

    # --------------------------------------------------------------------------- spans
    def start(self, name: str, parent: str | None = None, attributes: dict[str, Any] | None = None,
              start_time: float | None = None, links: list[str] | None = None):
        """A live span (end it with `end`)."""
        from opentelemetry import trace

        link_objs = []
        for tp in links or ():
            ctx = self.context_of(tp)
            sc = trace.get_current_span(ctx).get_span_context() if ctx is not None else None
            if sc is not None and sc.is_valid:
                link_objs.append(trace.Link(sc))
        return self.tracer.start_span(name, context=self.context_of(parent), attributes=attributes or {},
                                      start_time=_ns(start_time) if start_time else None, links=link_objs)

    @staticmethod
    def end(span, attributes: dict[str, Any] | None = None, error: str | None = None,
            end_time: float | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        for k, v in (attributes or {}).items():
            if v is not None:
                span.set_attribute(k, v)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(end_time) if end_time else None)

    def stage_spans(self, parent: str, marks: list[tuple[str, float]], end_time: float,
                    attributes: dict[str, Any], links: dict[str, str] | None = None,
                    error: str | None = None) -> None:
        """One span per stage of a request: stage i runs from its mark to the next one (the last to
        `end_time`). `links[stage]` is a traceparent the stage's span links to (the peer's)."""
        for i, (stage, t0) in enumerate(marks):
            t1 = marks[i + 1][1] if i + 1 < len(marks) else end_time
            span = self.start(stage, parent, attributes, start_time=t0,
                              links=[links[stage]] if links and stage in links else None)
            last = i + 1 == len(marks)
            self.end(span, error=error if last else None, end_time=max(t1, t0))

    def close(self) -> None:
        """Export what is left (bounded wait) and stop the exporter thread."""
        try:
            self.provider.force_flush(timeout_millis=3000)
            self.provider.shutdown()
        except Exception:  # the collector is gone: the spans are lost, the process still stops
            logger.warning("tracing: the last spans could not be exported to %s", self.url)

