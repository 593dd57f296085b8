"""The router's aiohttp application: endpoints (one route table, described at `GET /openapi.json`), keys by
role (`common/server/security.py`: client key on public routes, admin key on `/workers` and `/flush_cache`,
open probes and metrics), optional TLS, X-Request-ID, one log line per request."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid

import aiohttp
import msgspec
from aiohttp import web

from common.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ModelNotFound,
    check_request_id,
)
from common.server.openapi import Route, access_of, access_table, add_routes, unserved_routes, with_openapi
from common.server.security import (
    ADMIN,
    OPEN,
    Denied,
    bearer_token,
    check_access,
    client_ssl_context,
    server_ssl_context,
)
from common.version import VERSION
from router import dashboard
from router.capacity import DecodeCapacity
from router.config import RouterConfig
from router.dispatch import Dispatcher, NoWorkers, Trace
from router.limits import Admission, Rejected, check_length, read_body
from router.liveness import SilenceWatch
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.metrics import Metrics
from router.policies import make_policy
from router.registry import PREFILL, Registry
from router.request import parse
from router.retry import error_response
from router.role_switch import RoleSwitcher
from router.workers_api import WorkersApi, json_response

log = logging.getLogger("router")
REQUEST_ID = web.RequestKey("request_id", str)  # the id this router answers with (X-Request-ID)
GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
ADMIN_ROUTES = "GET/POST /workers, DELETE /workers/{id}, POST /workers/{id}/role and POST /flush_cache"


class RouterApp:
    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession):
        self.cfg = cfg
        self.session = session
        self.metrics = Metrics()
        self.tracer = None
        if cfg.enable_trace:
            from common.tracing import Tracer

            self.tracer = Tracer("pdserve-router", cfg.otlp_traces_endpoint or "localhost:4318")
        self.kv_index = None
        # a LightTokenizer (common/server/light_tokenizer.py), loaded at the first admission
        self.route_tokenizer = None
        self._tokenizer_tried: set[str] = set()
        if cfg.kv_events:
            from router.kv_index import KVEventIndex

            self.kv_index = KVEventIndex(cfg.kv_events_max_blocks)
            self.metrics.kv_index = self.kv_index
        self.prefill_policy = make_policy(cfg.effective_prefill_policy, cfg, self.kv_index,
                                          lambda: self.route_tokenizer)
        self.metrics.route_counts = getattr(self.prefill_policy, "counts", None)
        self.metrics.policies = {"prefill": cfg.effective_prefill_policy,
                                 "decode": cfg.effective_decode_policy}
        self.decode_policy = make_policy(cfg.effective_decode_policy, cfg)
        self.registry = Registry(cfg, session, on_change=self._workers_changed)
        self.switcher = RoleSwitcher(self.registry, session, cfg)
        self.workers = WorkersApi(self.registry, self.switcher, lambda: self.kv_index)
        if self.kv_index is not None:
            self.registry.on_admit = self._admit_prefill
        self.dispatcher = Dispatcher(cfg, self.registry, self.metrics,
                                     self.prefill_policy, self.decode_policy)
        self.registry.on_unhealthy = self.dispatcher.legs.cut_off
        self.capacity = DecodeCapacity(self.registry, session, cfg.load_check_interval_secs,
                                       cfg.health_check_timeout_secs, self.dispatcher.legs.auth)
        self.dispatcher.capacity = self.capacity
        self.silence = SilenceWatch(self.registry, session, cfg.worker_silence_timeout_secs,
                                    cfg.health_check_endpoint, on_silent=self.dispatcher.legs.cut_off,
                                    metrics=self.metrics) if cfg.worker_silence_timeout_secs > 0 else None
        self.keys = cfg.resolved_keys
        self.routes = self._routes()
        self.access = access_table(self.routes)
        self.id_headers = cfg.request_id_headers
        self.admission = Admission(cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout_secs,
                                   cfg.rate_limit_tokens_per_second)
        self.metrics.admission = self.admission

    def _workers_changed(self) -> None:
        urls = {w.url for w in self.registry.all()}
        self.dispatcher.legs.forget(urls)
        for policy in (self.prefill_policy, self.decode_policy):
            for url in set(getattr(policy, "trees", {})) | set(getattr(policy, "recent", {})):
                if url not in urls:
                    policy.forget(url)
        if self.kv_index is not None:
            prefill = {w.url for w in self.registry.prefill}
            for url in self.kv_index.urls() - prefill:
                self.kv_index.unsubscribe(url)

    async def _admit_prefill(self, w) -> None:
        """--kv-events: follow the worker's events (when it names an endpoint); load the tokenizer once."""
        views = self.kv_index.subscribe(w.url, w.server_info)
        if not views:
            log.warning("prefill worker %s publishes no KV events (start it with --kv-events-config): it is "
                        "routed by the approximate tree", w.url)
            return
        if self.route_tokenizer is None:
            await self._load_tokenizer(w)

    async def _load_tokenizer(self, w) -> None:
        from common.server.light_tokenizer import LightTokenizer

        path = self.cfg.tokenizer_path or self.cfg.model_path or w.model_info.get("tokenizer_path")
        if not isinstance(path, str) or path in self._tokenizer_tried:
            return
        self._tokenizer_tried.add(path)
        template_file = w.server_info.get("chat_template")  # the worker's --chat-template, on a shared path

        def open_tokenizer():  # file reads off the event loop
            template = None
            if isinstance(template_file, str) and os.path.isfile(template_file):
                with open(template_file, encoding="utf-8") as f:
                    template = f.read()
            return LightTokenizer.open(path, template)

        tok = await asyncio.get_running_loop().run_in_executor(None, open_tokenizer)
        if tok is None:
            log.warning("cannot read the tokenizer in %r as the nodes do (no tokenizer.json, or chat "
                        "templates in files by name): text prompts are routed by the approximate tree (give "
                        "--tokenizer-path)", path)
            return
        self.route_tokenizer = tok
        log.info("tokenizing prompts for --kv-events routing with %s", path)

    # ---------------------------------------------------------------------------- middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        rid = None
        headers = request.headers
        for name in self.id_headers:
            rid = headers.get(name)
            if rid:
                break
        if not rid:
            rid = uuid.uuid4().hex
        request[REQUEST_ID] = rid
        try:
            check_request_id(rid, "X-Request-ID")
        except BadRequest as e:
            request[REQUEST_ID] = uuid.uuid4().hex
            return error_response(400, str(e), headers={"X-Request-ID": request[REQUEST_ID]})
        try:
            check_access(access_of(request, self.access), request.path, bearer_token(headers), request.remote,
                         self.keys, accept_node_key=False)
        except Denied as e:
            log.info("rid=%s %s %s status=%d error=%s", rid, request.method,
                     request.path, e.status, e.message)
            return error_response(e.status, e.message, headers={"X-Request-ID": rid, **e.headers})
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            message = {404: f"no route {request.method} {request.path}",
                       405: f"method {request.method} is not allowed on "
                            f"{request.path}"}.get(e.status, e.reason)
            resp = error_response(e.status, message,
                                  headers={k: v for k, v in e.headers.items() if k == "Allow"} or None)
        if not resp.prepared:
            resp.headers["X-Request-ID"] = request[REQUEST_ID]
        return resp

    # ---------------------------------------------------------------------------- generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        path = request.path
        rid = request[REQUEST_ID]
        trace = Trace()
        status = 499
        admitted = False
        span = None
        if self.tracer is not None:
            span = self.tracer.start(f"router {path}",
                                     request.headers.get("traceparent"), {"pdserve.rid": rid})
            trace.traceparent = self.tracer.traceparent_of(span)
        try:
            try:
                check_length(request, self.cfg.max_payload_size)  # before queueing: nothing read
                await self.admission.acquire()
                admitted = True
                body = await read_body(request, self.cfg.max_payload_size)
            except Rejected as e:
                trace.status = status = e.status
                resp = error_response(e.status, e.message, headers=e.headers)
                if e.status == 413:  # the rest of the body is not wanted: no keep-alive on this connection
                    self.admission.rejected[e.reason] += 1
                    resp.force_close()
                return resp
            try:
                req = parse(path, body, self.dispatcher.need_text)
            except BadRequest as e:
                trace.status = status = 400
                return error_response(400, str(e))
            if req.dp_rank is not None and not self.cfg.dp_aware:
                trace.status = status = 400
                return error_response(400, "`data_parallel_rank` needs a router started with --dp-aware "
                                      "(without it a decode node places a request by its bootstrap_room)")
            if isinstance(req.client_rid, str):  # the body's rid names the request on every process
                rid = request[REQUEST_ID] = req.client_rid
            resp = await self.dispatcher.handle(request, req, rid, trace)
            status = trace.status
            return resp
        finally:
            if admitted:
                self.admission.release()
            t1 = time.perf_counter()
            self.metrics.observe(path, status, t1 - t0)
            first = (trace.first_byte or t1) - t0
            if trace.first_byte and status == 200:  # a stream: its first event, then one per token or so
                tokens = trace.events - 1  # its last event is [DONE]
                self.metrics.latency.add(first,
                                         (t1 - trace.first_byte) / (tokens - 1) if tokens > 1 else None)
            log.info("rid=%s %s status=%d prefill=%s decode=%s attempts=%d first_byte_ms=%.1f total_ms=%.1f",
                     rid, path, status, trace.prefill, trace.decode, trace.attempts,
                     first * 1e3, (t1 - t0) * 1e3)
            if span is not None:
                self.tracer.end(span, {"http.response.status_code": status, "pdserve.prefill": trace.prefill,
                                       "pdserve.decode": trace.decode, "pdserve.attempts": trace.attempts},
                                error=f"status {status}" if status >= 500 else None)

    # ---------------------------------------------------------------------------- info

    async def _first_prefill_get(self, paths: tuple[str, ...]):
        workers = [w for w in self.registry.prefill if w.available] or self.registry.prefill
        if not workers:
            return None
        w = workers[0]
        for path in paths:
            try:
                async with self.session.get(w.url + path, headers=self.registry.auth,
                                            timeout=aiohttp.ClientTimeout(
                                                total=self.cfg.health_check_timeout_secs)) as r:
                    if r.status == 200:
                        return msgspec.json.decode(await r.read())
            except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
                continue
        return None

    async def tokenize(self, request):
        """/tokenize and /detokenize: answered by a prefill worker (every worker has the model's
        tokenizer)."""
        workers = [w for w in self.registry.prefill if w.available] or self.registry.prefill
        if not workers:
            return error_response(503, "no prefill server available")
        try:
            body = await read_body(request, self.cfg.max_payload_size)
        except Rejected as e:
            return error_response(e.status, e.message, headers=e.headers)
        try:
            async with self.session.post(workers[0].url + request.path, data=body, headers={
                    **self.registry.auth, "Content-Type": "application/json",
                    "X-Request-ID": request[REQUEST_ID]},
                    timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_secs)) as r:
                body = await r.read()
                if r.content_type != "application/json":  # not a pdserve node's answer (an older one: 404)
                    return error_response(502, f"{workers[0].url} answered {r.status} to {request.path}")
                return web.Response(body=body, status=r.status, content_type="application/json")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return error_response(502, f"tokenizing on {workers[0].url} failed: {e}")

    async def server_info(self, request):
        info = await self._first_prefill_get(("/server_info", "/get_server_info"))
        if info is None:
            return error_response(503, "no prefill server available")
        if isinstance(info, dict):  # a prefill worker's, plus the router's own admission counters
            info["router"] = self.admission.describe()
            if self.kv_index is not None:
                info["router"]["kv_events"] = {"workers": {u: v.describe()
                                                           for u, v in list(self.kv_index.views.items())},
                                               "routes": dict(self.metrics.route_counts or {})}
        return json_response(info)

    async def model_info(self, request):
        info = await self._first_prefill_get(("/model_info", "/get_model_info"))
        if info is None:
            return error_response(503, "no prefill server available")
        return json_response(info)

    async def _models(self) -> dict | None:
        """A prefill worker's `/v1/models` (the pool serves one model), else a list made of what its
        `/server_info` said at registration; None without a prefill worker."""
        data = await self._first_prefill_get(("/v1/models",))
        if data is None:
            ws = self.registry.prefill
            if not ws:
                return None
            name = ws[0].server_info.get("served_model_name") or ws[0].model_info.get("served_model_name")
            data = {"object": "list",
                    "data": [{"id": name or "default", "object": "model", "owned_by": "pdserve"}]}
        return data

    async def models(self, request):
        data = await self._models()
        if data is None:
            return error_response(503, "no prefill server available")
        return json_response(data)

    async def model(self, request):
        """`GET /v1/models/{model}`: the served model's card; another name is a 404 `model_not_found`."""
        data = await self._models()
        if data is None:
            return error_response(503, "no prefill server available")
        name = request.match_info["model"]
        cards = [c for c in data.get("data", ()) if isinstance(c, dict)]
        for card in cards:
            if card.get("id") == name:
                return json_response(card)
        served = ", ".join(str(c.get("id")) for c in cards)
        return error_response(404, str(ModelNotFound(name, served)), code="model_not_found")

    async def health(self, request):
        return json_response({"status": "ok"})

    async def readiness(self, request):
        r = self.registry
        body = {"status": "ready" if r.ready() else "not ready",
                "healthy_prefill": sum(w.available for w in r.prefill), "total_prefill": len(r.prefill),
                "healthy_decode": sum(w.available for w in r.decode), "total_decode": len(r.decode)}
        return json_response(body, 200 if r.ready() else 503)

    async def get_loads(self, request):
        await self.registry.refresh_loads()
        ws = self.registry.all()
        loads = [{"worker": w.url, "worker_type": w.kind, "load": -1 if w.load is None else w.load}
                 for w in ws]
        ok = sum(1 for x in loads if x["load"] >= 0)
        return json_response({"workers": loads, "total_workers": len(ws), "successful": ok,
                              "failed": len(ws) - ok})

    async def metrics_handler(self, request):
        return web.Response(body=self.metrics.render(self.registry.all()).encode(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _fan_out(self, method: str, path: str, workers) -> list[str]:
        async def one(w):
            try:
                async with self.session.request(method, w.url + path, headers=self.registry.auth,
                                                timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await r.read()
                    return None if r.status < 300 else f"{w.url} answered {r.status}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                return f"{w.url}: {e!r}"

        return [e for e in await asyncio.gather(*(one(w) for w in workers)) if e]

    async def flush_cache(self, request):
        errors = await self._fan_out("POST", "/flush_cache", self.registry.all())
        if errors:
            return error_response(502, "; ".join(errors))
        return json_response({"status": "ok"})

    async def version(self, request):
        return json_response({"version": VERSION})

    async def health_generate(self, request):
        try:
            p, d = self.dispatcher.pick(None, ())
        except NoWorkers as e:
            return error_response(503, str(e))
        errors = await self._fan_out("GET", "/health_generate", [p, d])
        if errors:
            return error_response(503, "; ".join(errors))
        return json_response({"status": "ok", "prefill": p.url, "decode": d.url})

    async def dashboard_page(self, request):
        return web.Response(text=dashboard.PAGE, content_type="text/html",
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy":
                                     "default-src 'none'; script-src 'unsafe-inline'; style-src "
                                     "'unsafe-inline'; connect-src 'self'"})

    async def dashboard_data(self, request):
        return json_response(await dashboard.dashboard_data(self))

    # ---------------------------------------------------------------------------- assembly

    def _routes(self) -> list[Route]:
        bodies = (GenerateRequest, CompletionRequest, ChatCompletionRequest)
        return with_openapi([
            *(Route("POST", p, self.generate, b, summary="generation through a prefill and a decode worker",
                    stream=True) for p, b in zip(GENERATE_PATHS, bodies, strict=True)),
            *self.workers.routes(ADMIN),
            Route("POST", "/flush_cache", self.flush_cache, access=ADMIN,
                  summary="flush every worker's cache"),
            Route("GET", "/v1/models", self.models, summary="the served model"),
            Route("GET", "/v1/models/{model:.+}", self.model, summary="the served model's card, by its name"),
            *unserved_routes(),
            *(Route("POST", p, self.tokenize,
                    summary="text or chat messages to token ids (a prefill worker's)")
              for p in ("/tokenize", "/v1/tokenize")),
            *(Route("POST", p, self.tokenize, summary="token ids to text (a prefill worker's)")
              for p in ("/detokenize", "/v1/detokenize")),
            Route("GET", "/get_loads", self.get_loads, summary="every worker's load"),
            *(Route("GET", p, self.server_info, summary="a prefill worker's server information")
              for p in ("/get_server_info", "/server_info")),
            *(Route("GET", p, self.model_info, summary="a prefill worker's model information")
              for p in ("/get_model_info", "/model_info")),
            Route("GET", "/health", self.health, access=OPEN, summary="liveness"),
            Route("GET", "/version", self.version, access=OPEN, summary="the pdserve version"),
            Route("GET", "/liveness", self.health, access=OPEN, summary="liveness"),
            Route("GET", "/readiness", self.readiness, access=OPEN,
                  summary="a prefill and a decode worker up"),
            Route("GET", "/health_generate", self.health_generate, access=OPEN,
                  summary="readiness: one step on a prefill and a decode worker"),
            Route("GET", "/metrics", self.metrics_handler, access=OPEN,
                  summary="Prometheus metrics (no secrets)"),
            Route("GET", "/dashboard", self.dashboard_page, access=OPEN,
                  summary="the live cluster page (no data)"),
            Route("GET", "/dashboard/data", self.dashboard_data, summary="what the live cluster page shows"),
        ], "pdserve router", VERSION)

    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_payload_size, middlewares=[self.middleware])
        add_routes(app, self.routes)
        return app

    async def evict_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.eviction_interval_secs)
            self.prefill_policy.evict()
            self.decode_policy.evict()


async def serve(cfg: RouterConfig, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    tls_in = server_ssl_context(cfg.ssl_certfile, cfg.ssl_keyfile)
    # https:// workers (health, info, loads) verified against --ssl-ca-certs or the system's CAs
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=120,
                                     ssl=client_ssl_context(cfg.ssl_ca_certs))
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
        total=cfg.request_timeout_secs), auto_decompress=False, skip_auto_headers=("User-Agent",))
    ra = RouterApp(cfg, session)
    ra.planner = None  # --planner slo (router/planner.py); the dashboard shows it
    if cfg.planner == "slo":
        from router.planner import Planner, make_actuator

        ra.planner = Planner(cfg, ra.registry, ra.metrics, session, make_actuator(cfg, ra))
    runner = web.AppRunner(ra.build(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port, backlog=4096, reuse_address=True,
                      ssl_context=tls_in).start()
    prom = None
    if cfg.prometheus_port:
        papp = web.Application()
        papp.router.add_get("/metrics", ra.metrics_handler)
        prom = web.AppRunner(papp, access_log=None)
        await prom.setup()
        await web.TCPSite(prom, cfg.prometheus_host or cfg.host, cfg.prometheus_port,
                          reuse_address=True).start()
    need_loads = "power_of_two" in (cfg.effective_prefill_policy, cfg.effective_decode_policy)
    ra.registry.start(need_loads)
    if ra.planner is not None:
        ra.planner.start()
    watcher = None
    if cfg.service_discovery:
        from router.discovery import PodWatcher

        watcher = PodWatcher(cfg, ra.registry, asyncio.get_running_loop())
        watcher.start()
    evict = asyncio.get_running_loop().create_task(ra.evict_loop())
    silence = asyncio.get_running_loop().create_task(ra.silence.run()) if ra.silence is not None else None
    capacity = asyncio.get_running_loop().create_task(ra.capacity.run())
    log.info("router listening on %s://%s:%d (prefill policy %s, decode policy %s, %d prefill, %d "
             "decode, %r)", "https" if tls_in else "http", cfg.host, cfg.port, cfg.effective_prefill_policy,
             cfg.effective_decode_policy, len(cfg.prefill), len(cfg.decode), ra.keys)
    ra.keys.announce(log, ADMIN_ROUTES)
    if ra.admission.enabled:
        a = ra.admission
        log.info("admission: --max-concurrent-requests %d, --queue-size %d, --queue-timeout-secs %g, "
                 "--rate-limit-tokens-per-second %s", a.max_concurrent or -1, a.queue_size, a.queue_timeout,
                 f"{a.bucket.rate:g}" if a.bucket else "off")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        if ra.planner is not None:
            await ra.planner.stop()
        evict.cancel()
        capacity.cancel()
        if silence is not None:
            silence.cancel()
        if watcher is not None:
            watcher.stop()
        await ra.registry.stop()
        if ra.kv_index is not None:
            ra.kv_index.close()
        await runner.cleanup()
        if prom is not None:
            await prom.cleanup()
        await session.close()
        if ra.tracer is not None:
            await loop.run_in_executor(None, ra.tracer.close)


def run(cfg: RouterConfig) -> None:
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        uvloop.run(serve(cfg))
    else:
        asyncio.run(serve(cfg))


__all__ = ["RouterApp", "serve", "run", "PREFILL"]
