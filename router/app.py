"""The router's aiohttp application: endpoints, bearer-token auth, X-Request-ID, one log line per request."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

import aiohttp
import msgspec
from aiohttp import web

from common.protocol import BadRequest
from router.config import RouterConfig
from router.dispatch import Dispatcher, NoWorkers, Trace, error_response
from router.metrics import Metrics
from router.policies import make_policy
from router.registry import PREFILL, Registry, RegistryError
from router.request import parse

log = logging.getLogger("router")
_encode = msgspec.json.encode
OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness"})
GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


class RouterApp:
    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession):
        self.cfg = cfg
        self.session = session
        self.metrics = Metrics()
        self.prefill_policy = make_policy(cfg.effective_prefill_policy, cfg)
        self.decode_policy = make_policy(cfg.effective_decode_policy, cfg)
        self.registry = Registry(cfg, session, on_change=self._workers_changed)
        self.dispatcher = Dispatcher(cfg, self.registry, session, self.metrics, self.prefill_policy,
                                     self.decode_policy)
        self.expected_auth = f"Bearer {cfg.api_key}" if cfg.api_key else None
        self.id_headers = cfg.request_id_headers
        self.limit = asyncio.Semaphore(cfg.max_concurrent_requests) if cfg.max_concurrent_requests > 0 else None

    def _workers_changed(self) -> None:
        urls = {w.url for w in self.registry.all()}
        self.dispatcher.forget(urls)
        for policy in (self.prefill_policy, self.decode_policy):
            for url in list(getattr(policy, "trees", {})):
                if url not in urls:
                    policy.forget(url)

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
        request["request_id"] = rid
        if self.expected_auth is not None and request.path not in OPEN_PATHS \
                and headers.get("Authorization") != self.expected_auth:
            return error_response(401, "missing or invalid API key (expected `Authorization: Bearer <key>`)",
                                  headers={"X-Request-ID": rid})
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            resp = error_response(e.status, e.reason)
        if not resp.prepared:
            resp.headers["X-Request-ID"] = rid
        return resp

    # ---------------------------------------------------------------------------- generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        path = request.path
        rid = request["request_id"]
        trace = Trace()
        status = 499
        try:
            body = await request.read()
            try:
                req = parse(path, body, self.dispatcher.need_text)
            except BadRequest as e:
                trace.status = status = 400
                return error_response(400, str(e))
            if self.limit is None:
                resp = await self.dispatcher.handle(request, req, rid, trace)
            else:
                async with self.limit:
                    resp = await self.dispatcher.handle(request, req, rid, trace)
            status = trace.status
            return resp
        finally:
            t1 = time.perf_counter()
            self.metrics.observe(path, status, t1 - t0)
            first = (trace.first_byte or t1) - t0
            log.info("rid=%s %s status=%d prefill=%s decode=%s attempts=%d first_byte_ms=%.1f total_ms=%.1f",
                     rid, path, status, trace.prefill, trace.decode, trace.attempts, first * 1e3, (t1 - t0) * 1e3)

    # ---------------------------------------------------------------------------- workers

    async def list_workers(self, request):
        ws = [w.describe() for w in self.registry.all()]
        return json_response({"workers": ws, "total": len(ws),
                              "prefill": len(self.registry.prefill), "decode": len(self.registry.decode)})

    async def add_worker(self, request):
        try:
            spec = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            return error_response(400, f"malformed JSON: {e}")
        if not isinstance(spec, dict):
            return error_response(400, "request body must be a JSON object")
        url, kind, port = spec.get("url"), spec.get("worker_type", "decode"), spec.get("bootstrap_port")
        if not isinstance(url, str) or not url:
            return error_response(400, "`url` is required and must be a string")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
            return error_response(400, "`bootstrap_port` must be an integer port or null")
        try:
            w = await self.registry.add(url, kind, port, explicit_none="bootstrap_port" in spec and port is None)
        except RegistryError as e:
            return error_response(e.status, str(e))
        return json_response({"status": "ok", "worker": w.describe()})

    async def remove_worker(self, request):
        try:
            w = self.registry.remove(request.match_info["id"])
        except RegistryError as e:
            return error_response(e.status, str(e))
        return json_response({"status": "ok", "worker": w.describe()})

    # ---------------------------------------------------------------------------- info

    async def _first_prefill_get(self, paths: tuple[str, ...]):
        workers = [w for w in self.registry.prefill if w.available] or self.registry.prefill
        if not workers:
            return None
        w = workers[0]
        for path in paths:
            try:
                async with self.session.get(w.url + path, headers=self.registry.auth,
                                            timeout=aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_secs)) as r:
                    if r.status == 200:
                        return msgspec.json.decode(await r.read())
            except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
                continue
        return None

    async def server_info(self, request):
        info = await self._first_prefill_get(("/server_info", "/get_server_info"))
        if info is None:
            return error_response(503, "no prefill server available")
        return json_response(info)

    async def model_info(self, request):
        info = await self._first_prefill_get(("/model_info", "/get_model_info"))
        if info is None:
            return error_response(503, "no prefill server available")
        return json_response(info)

    async def models(self, request):
        data = await self._first_prefill_get(("/v1/models",))
        if data is None:
            ws = self.registry.prefill
            if not ws:
                return error_response(503, "no prefill server available")
            name = ws[0].model_info.get("model_path") or ws[0].server_info.get("model_path") or "default"
            data = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "pdserve"}]}
        return json_response(data)

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
        loads = [{"worker": w.url, "worker_type": w.kind, "load": -1 if w.load is None else w.load} for w in ws]
        ok = sum(1 for x in loads if x["load"] >= 0)
        return json_response({"workers": loads, "total_workers": len(ws), "successful": ok,
                              "failed": len(ws) - ok})

    async def metrics_handler(self, request):
        return web.Response(text=self.metrics.render(self.registry.all()), content_type="text/plain")

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

    async def health_generate(self, request):
        try:
            p, d = self.dispatcher.pick(None, ())
        except NoWorkers as e:
            return error_response(503, str(e))
        errors = await self._fan_out("GET", "/health_generate", [p, d])
        if errors:
            return error_response(503, "; ".join(errors))
        return json_response({"status": "ok", "prefill": p.url, "decode": d.url})

    # ---------------------------------------------------------------------------- assembly

    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_payload_size, middlewares=[self.middleware])
        r = app.router
        for path in GENERATE_PATHS:
            r.add_post(path, self.generate)
        r.add_get("/workers", self.list_workers)
        r.add_post("/workers", self.add_worker)
        r.add_delete("/workers/{id:.+}", self.remove_worker)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/liveness", self.health)
        r.add_get("/readiness", self.readiness)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_loads", self.get_loads)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/metrics", self.metrics_handler)
        r.add_post("/flush_cache", self.flush_cache)
        return app

    async def evict_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.eviction_interval_secs)
            self.prefill_policy.evict()
            self.decode_policy.evict()


async def serve(cfg: RouterConfig, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=120)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
        total=cfg.request_timeout_secs), auto_decompress=False, skip_auto_headers=("User-Agent",))
    ra = RouterApp(cfg, session)
    runner = web.AppRunner(ra.build(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port, backlog=4096, reuse_address=True).start()
    prom = None
    if cfg.prometheus_port:
        papp = web.Application()
        papp.router.add_get("/metrics", ra.metrics_handler)
        prom = web.AppRunner(papp, access_log=None)
        await prom.setup()
        await web.TCPSite(prom, cfg.prometheus_host or cfg.host, cfg.prometheus_port, reuse_address=True).start()
    need_loads = "power_of_two" in (cfg.effective_prefill_policy, cfg.effective_decode_policy)
    ra.registry.start(need_loads)
    evict = asyncio.get_running_loop().create_task(ra.evict_loop())
    log.info("router listening on %s:%d (prefill policy %s, decode policy %s, %d prefill, %d decode)",
             cfg.host, cfg.port, cfg.effective_prefill_policy, cfg.effective_decode_policy,
             len(cfg.prefill), len(cfg.decode))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        evict.cancel()
        await ra.registry.stop()
        await runner.cleanup()
        if prom is not None:
            await prom.cleanup()
        await session.close()


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
