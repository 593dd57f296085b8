"""What a node's first scheduler rank publishes for observers: a released request's stages as spans
(`--enable-trace`: the marks `Req.mark` recorded, from its arrival to its release, under the front end's
span of the request), and the prefix cache's blocks as KV events (`--kv-events-config`; the other ranks'
caches are equal, so one rank speaks for them)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front end imports make_tracer, and need not import torch for it
    from common.scheduler.req import Req


def make_tracer(args):
    """The node's Tracer with --enable-trace, else None."""
    if not getattr(args, "enable_trace", False):
        return None
    from common.config import DEFAULT_OTLP_ENDPOINT
    from common.tracing import Tracer, service_name

    return Tracer(service_name(args.disaggregation_mode), args.otlp_traces_endpoint or DEFAULT_OTLP_ENDPOINT)


def export_stage_spans(tracer, req: Req) -> None:
    marks = req.marks
    if not marks or marks[0][1] > req.arrival_time:
        # before its first stage: in the pipe, or a role's intake
        marks = [("queued", req.arrival_time), *marks]
    reason = req.finished_reason or {}
    error = reason.get("message") if reason.get("type") == "abort" else None
    attrs = {"pdserve.rid": req.rid, "pdserve.prompt_tokens": len(req.origin_input_ids),
             "pdserve.output_tokens": len(req.output_ids), "pdserve.cached_tokens": req.cached_tokens}
    if req.bootstrap_room is not None:
        attrs["pdserve.bootstrap_room"] = req.bootstrap_room
    tracer.stage_spans(req.traceparent, marks, time.time(), attrs, links=req.trace_links, error=error)


def make_kv_events(args, tree_cache, page_size: int, dp_rank: int, runner):
    """The publisher of `tree_cache`'s blocks (`common/kv_events.py`), installed as its event sink; None
    without --kv-events-config or without a prefix cache."""
    if not getattr(args, "kv_events_config", None) or not tree_cache.enabled:
        return None
    from common.kv_events import KVEventPublisher, KVEventsConfig

    cfg = KVEventsConfig.parse(args.kv_events_config, args.host, args.dp_size).for_dp_rank(dp_rank)
    if not cfg.enabled:
        return None
    window = getattr(getattr(runner, "hybrid", None), "window", None)
    tree_cache.events = KVEventPublisher(cfg, page_size,
                                         dp_rank if args.dp_size > 1 else None, sliding_window=window)
    return tree_cache.events
