"""Bootstrap rendezvous: an aiohttp server run by each prefill node, and the decode side's client.

Server routes:
* `PUT /route` — a prefill rank registers itself: JSON with role, tp/dp/pp rank and size, rank_ip,
  rank_port (its ZMQ control socket), page_size, model, kv_layout, kv_heads_total. The first registration fixes the node's layout; a later one whose page size, model,
  KV layout, head count or parallel sizes differ is rejected with 409 and a message naming both values.
* `GET /route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1` — the parallel layout
  `{"tp_size", "dp_size", "pp_size", "page_size", "model", "kv_heads_total", "kv_layout", "ranks"}`
  (404 until a rank registered).
* `GET /route?engine_rank=R&target_dp_group=G&target_pp_rank=P` — that rank's
  `{"rank_ip", "rank_port"}` (404 until it registered).
* `GET /health` — 200 "OK".

`BootstrapServer(host, port).start()` runs the server on its own event loop in a daemon thread;
`await server.start_async()` runs it on the caller's loop instead. `BootstrapClient` (plain HTTP,
callable from any thread) registers ranks and answers the decode side's lookups, caching successful
answers per bootstrap address until `invalidate()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from aiohttp import web

logger = logging.getLogger(__name__)

_REQUIRED = ("role", "tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank_ip",
             "rank_port", "page_size", "model", "kv_layout", "kv_heads_total")
# fields every rank of one prefill node must agree on
_LAYOUT_KEYS = ("page_size", "model", "kv_layout", "kv_heads_total", "tp_size", "dp_size", "pp_size")


class BootstrapServer:
    def __init__(self, host: str = "0.0.0.0", port: int = 8998) -> None:
        self.host = host
        self.port = port
        self._layout: dict | None = None
        self._ranks: dict[tuple[int, int, int], dict] = {}
        self._lock = threading.Lock()
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- handlers
    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.Response(status=400, text="PUT /route needs a JSON body")
        missing = [k for k in _REQUIRED if k not in body]
        if missing:
            return web.Response(status=400, text=f"PUT /route is missing fields: {', '.join(missing)}")
        if body["role"] != "prefill":
            return web.Response(status=400, text=f"only prefill ranks register, got role {body['role']!r}")
        with self._lock:
            if self._layout is None:
                self._layout = {k: body[k] for k in _LAYOUT_KEYS}
            else:
                for k in _LAYOUT_KEYS:
                    if self._layout[k] != body[k]:
                        msg = (f"{k} mismatch: this bootstrap server's prefill ranks use {k}={self._layout[k]!r}, "
                               f"the registering rank (tp {body['tp_rank']}, dp {body['dp_rank']}, "
                               f"pp {body['pp_rank']}) has {k}={body[k]!r}")
                        logger.error("bootstrap registration rejected: %s", msg)
                        return web.Response(status=409, text=msg)
            key = (int(body["dp_rank"]), int(body["tp_rank"]), int(body["pp_rank"]))
            self._ranks[key] = {"rank_ip": body["rank_ip"], "rank_port": int(body["rank_port"])}
        logger.info("bootstrap: registered prefill rank dp %d tp %d pp %d at %s:%s", key[0], key[1], key[2],
                    body["rank_ip"], body["rank_port"])
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        try:
            engine_rank = int(request.query.get("engine_rank", "-1"))
            dp = int(request.query.get("target_dp_group", "-1"))
            pp = int(request.query.get("target_pp_rank", "-1"))
        except ValueError:
            return web.Response(status=400, text="engine_rank, target_dp_group, target_pp_rank must be ints")
        with self._lock:
            if self._layout is None:
                return web.Response(status=404, text="no prefill rank registered yet")
            if engine_rank == -1:
                return web.json_response({**self._layout, "ranks": len(self._ranks)})
            info = self._ranks.get((max(dp, 0), engine_rank, max(pp, 0)))
        if info is None:
            return web.Response(status=404, text=f"prefill rank tp {engine_rank} dp {dp} pp {pp} not registered")
        return web.json_response(info)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_get("/health", self._health)
        return app

    # ---- lifecycle
    async def start_async(self) -> None:
        """Serve on the running event loop."""
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # bound port for port=0
        logger.info("bootstrap server listening on %s:%d", self.host, self.port)

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> None:
        """Serve from a daemon thread with its own event loop; returns once the port is bound."""
        started = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as e:  # report bind errors to the caller
                error.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            loop.close()

        self._thread = threading.Thread(target=run, name="bootstrap-server", daemon=True)
        self._thread.start()
        started.wait()
        if error:
            raise RuntimeError(f"bootstrap server could not listen on {self.host}:{self.port}: {error[0]}")

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._thread = None
            self._loop = None


class BootstrapError(RuntimeError):
    """The bootstrap server answered with an error that retrying will not fix (e.g. 409)."""


class BootstrapClient:
    """HTTP client for the bootstrap routes; GET answers are cached per bootstrap address."""

    def __init__(self, timeout: float = 2.0) -> None:
        self.timeout = timeout
        self._layouts: dict[str, dict] = {}
        self._ranks: dict[tuple[str, int, int, int], dict] = {}
        self._unreachable_since: dict[str, float] = {}
        self._lock = threading.Lock()
        # bootstrap traffic stays inside the cluster: never route it through an HTTP proxy
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _request(self, method: str, url: str, body: dict | None = None) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        addr = urllib.parse.urlsplit(url).netloc
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                result = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            result = e.code, e.read().decode(errors="replace")
        except OSError:
            with self._lock:
                self._unreachable_since.setdefault(addr, time.monotonic())
            raise
        with self._lock:
            self._unreachable_since.pop(addr, None)
        return result

    def unreachable_for(self, bootstrap_addr: str) -> float:
        """Seconds since requests to this server started failing to connect (0 when it answers)."""
        with self._lock:
            since = self._unreachable_since.get(bootstrap_addr)
        return 0.0 if since is None else time.monotonic() - since

    def register(self, bootstrap_addr: str, info: dict) -> None:
        """PUT /route; raises BootstrapError on a rejected registration, OSError if unreachable."""
        status, text = self._request("PUT", f"http://{bootstrap_addr}/route", info)
        if status != 200:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} rejected the registration ({status}): {text}")

    def layout(self, bootstrap_addr: str) -> dict | None:
        """The prefill node's parallel layout, or None if no rank registered yet / unreachable."""
        with self._lock:
            if bootstrap_addr in self._layouts:
                return self._layouts[bootstrap_addr]
        try:
            status, text = self._request(
                "GET", f"http://{bootstrap_addr}/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1")
        except OSError:
            return None
        if status != 200:
            return None
        layout = json.loads(text)
        with self._lock:
            self._layouts[bootstrap_addr] = layout
        return layout

    def rank(self, bootstrap_addr: str, tp_rank: int, dp_rank: int, pp_rank: int) -> dict | None:
        """A prefill rank's control address, or None if not registered yet / unreachable."""
        key = (bootstrap_addr, tp_rank, dp_rank, pp_rank)
        with self._lock:
            if key in self._ranks:
                return self._ranks[key]
        try:
            status, text = self._request(
                "GET", f"http://{bootstrap_addr}/route?engine_rank={tp_rank}&target_dp_group={dp_rank}"
                       f"&target_pp_rank={pp_rank}")
        except OSError:
            return None
        if status != 200:
            return None
        info = json.loads(text)
        with self._lock:
            self._ranks[key] = info
        return info

    def invalidate(self, bootstrap_addr: str) -> None:
        """Forget cached answers of one bootstrap address (its prefill node restarted or died)."""
        with self._lock:
            self._layouts.pop(bootstrap_addr, None)
            for key in [k for k in self._ranks if k[0] == bootstrap_addr]:
                del self._ranks[key]

    def health(self, bootstrap_addr: str) -> bool:
        try:
            return self._request("GET", f"http://{bootstrap_addr}/health")[0] == 200
        except OSError:
            return False
