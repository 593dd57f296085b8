"""Bootstrap rendezvous: an aiohttp server run by each prefill node, and the decode side's client.

Server routes:
* `PUT /route` — a prefill rank registers itself: JSON with role, tp/dp/pp rank and size, rank_ip,
  rank_port (its ZMQ control socket), page_size, model, kv_layout, kv_heads_total, and optionally the
  node's compatibility `fingerprint` (common/fingerprint.py; "" when not given). The first
  registration fixes the node's layout; a later one whose page size, model, KV layout, head count,
  fingerprint or parallel sizes differ is rejected with 409 and a message naming both values.
* `GET /route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1` — the parallel layout
  `{"tp_size", "dp_size", "pp_size", "page_size", "model", "kv_heads_total", "kv_layout", "fingerprint",
  "ranks"}` (404 until a rank registered); the decode side refuses a fingerprint other than its own.
* `GET /route?engine_rank=R&target_dp_group=G&target_pp_rank=P` — that rank's
  `{"rank_ip", "rank_port"}` (404 until it registered).
* `GET /health` — 200 "OK" (always open).

Guards. With a cluster secret every `/route` request must carry `X-PDServe-Auth` (`transfer/auth.py`:
timestamp, nonce and HMAC over method, request-target and body); one without a valid one gets 401,
and every answer to an authenticated request carries a MAC bound to that request's nonce, which the
client checks. Bodies over `MAX_BODY_BYTES` get 413, undecodable ones 400; each kind of drop is
counted (`guard_stats()`). A registration never silently replaces a live one: a `PUT /route` for a rank
already registered at another address is refused (409, naming the rank and both addresses) while
the old address still accepts TCP connections (its control socket), and replaces it with a warning
once it does not; the same address registering again is a no-op. Without a secret anyone who can
reach the port can register the first rank of a node (and so fix its layout) and read the routes.

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

from common.cluster_secret import ClusterSecret, load_configured, warn_unauthenticated
from transfer.auth import DEFAULT_WINDOW, HTTP_HEADER, Authenticator, AuthError, DropCounters

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024  # a registration is ~300 bytes of JSON
PROBE_TIMEOUT = 1.0  # seconds to connect to a registered rank's control port before calling it dead

_REQUIRED = ("role", "tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank_ip",
             "rank_port", "page_size", "model", "kv_layout", "kv_heads_total")
# fields every rank of one prefill node must agree on
_LAYOUT_KEYS = ("page_size", "model", "kv_layout", "kv_heads_total", "tp_size", "dp_size",
                "pp_size", "fingerprint")
MAX_FINGERPRINT = 128  # characters of a registration's optional `fingerprint`
_INT_FIELDS = ("tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank_port", "page_size",
               "kv_heads_total")
_STR_FIELDS = ("role", "rank_ip", "model", "kv_layout")


def _field_problem(body: dict) -> str | None:
    """Why a registration's fields are unusable (wrong types or ranges), or None."""
    for k in _INT_FIELDS:
        if type(body[k]) is not int or not 0 <= body[k] < 2**31:
            return f"{k} must be a non-negative integer, got {body[k]!r}"[:200]
    for k in _STR_FIELDS:
        if not isinstance(body[k], str) or len(body[k]) > 256:
            return f"{k} must be a string of at most 256 characters"
    fingerprint = body.get("fingerprint", "")
    if not isinstance(fingerprint, str) or len(fingerprint) > MAX_FINGERPRINT:
        return f"fingerprint must be a string of at most {MAX_FINGERPRINT} characters"
    if not 0 < body["rank_port"] < 65536:
        return f"rank_port must be a TCP port (1-65535), got {body['rank_port']}"
    for kind in ("tp", "dp", "pp"):
        if not body[f"{kind}_rank"] < body[f"{kind}_size"]:
            return f"{kind}_rank {body[f'{kind}_rank']} is not below {kind}_size {body[f'{kind}_size']}"
    return None


async def _accepts_connections(ip: str, port: int) -> bool:
    """Whether something listens at ip:port (a registered rank's control socket)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), PROBE_TIMEOUT)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


class BootstrapServer:
    """`secret`: the cluster secret every `/route` request must be signed with (None: the one
    `$PDSERVE_CLUSTER_SECRET_FILE` names, else none: open)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 8998, secret: ClusterSecret | None = None,
                 auth_window: float = DEFAULT_WINDOW) -> None:
        self.host = host
        self.port = port
        secret = secret if secret is not None else load_configured(None)  # $PDSERVE_CLUSTER_SECRET_FILE
        self._auth = Authenticator(secret, auth_window) if secret is not None else None
        if secret is None:
            warn_unauthenticated(logger, "the bootstrap server")
        self.counters = DropCounters("bootstrap server", logger)
        self.registrations_refused = 0
        self.registrations_replaced = 0
        self._layout: dict | None = None
        self._ranks: dict[tuple[int, int, int], dict] = {}
        self._lock = threading.Lock()
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def guard_stats(self) -> dict[str, int]:
        return {**self.counters.as_stats("bootstrap_"),
                "bootstrap_registrations_refused": self.registrations_refused,
                "bootstrap_registrations_replaced": self.registrations_replaced}

    # ---- handlers
    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Size limit and authentication of every route but /health; signs the answer."""
        if request.path == "/health":
            return await handler(request)
        if (request.content_length or 0) > MAX_BODY_BYTES:
            self.counters.drop("oversized",
                               f"{request.content_length} byte body on {request.method} {request.path}")
            return web.Response(status=413, text=f"bodies are limited to {MAX_BODY_BYTES} bytes")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.counters.drop("oversized",
                               f"body over {MAX_BODY_BYTES} bytes on {request.method} {request.path}")
            return web.Response(status=413, text=f"bodies are limited to {MAX_BODY_BYTES} bytes")
        if self._auth is None:
            return await handler(request)
        try:
            nonce = self._auth.check_request(request.method, request.raw_path, body,
                                             request.headers.get(HTTP_HEADER))
        except AuthError as e:
            self.counters.drop_auth(e)
            return web.Response(status=401, text="cluster authentication failed (missing, bad or stale "
                                "X-PDServe-Auth; do both sides use the same cluster secret?)")
        resp = await handler(request)
        if isinstance(resp, web.Response):
            resp.headers[HTTP_HEADER] = self._auth.response_header(nonce, resp.status, resp.body or b"")
        return resp

    def _bad(self, text: str) -> web.Response:
        self.counters.drop("undecodable", text)
        return web.Response(status=400, text=text)

    async def _put_route(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return self._bad("PUT /route needs a JSON body")
        if not isinstance(body, dict):
            return self._bad("PUT /route needs a JSON object")
        missing = [k for k in _REQUIRED if k not in body]
        if missing:
            return self._bad(f"PUT /route is missing fields: {', '.join(missing)}")
        problem = _field_problem(body)
        if problem:
            return self._bad(f"PUT /route: {problem}")
        if body["role"] != "prefill":
            return self._bad(f"only prefill ranks register, got role {body['role']!r}"[:200])
        # a rank that names none (older nodes): not compared by the decode side
        body.setdefault("fingerprint", "")
        key = (body["dp_rank"], body["tp_rank"], body["pp_rank"])
        new = {"rank_ip": body["rank_ip"], "rank_port": body["rank_port"]}
        with self._lock:
            old = self._ranks.get(key)
        if old is not None and old != new:
            refused = await self._refuse_replacement(key, old, new)
            if refused is not None:
                return refused
        with self._lock:
            if self._layout is None:
                self._layout = {k: body[k] for k in _LAYOUT_KEYS}
            else:
                for k in _LAYOUT_KEYS:
                    if self._layout[k] != body[k]:
                        msg = (f"{k} mismatch: this bootstrap server's prefill ranks use "
                               f"{k}={self._layout[k]!r}, the registering rank (tp {body['tp_rank']}, dp "
                               f"{body['dp_rank']}, pp {body['pp_rank']}) has {k}={body[k]!r}")
                        logger.error("bootstrap registration rejected: %s", msg)
                        return web.Response(status=409, text=msg)
            if self._ranks.get(key) not in (old, new):
                return web.Response(status=409, text=f"{_rank_name(key)} was registered by another request "
                                    "meanwhile; retry")
            self._ranks[key] = new
        if old != new:
            logger.info("bootstrap: registered %s at %s:%s", _rank_name(key),
                        body["rank_ip"], body["rank_port"])
        return web.Response(text="OK")

    async def _refuse_replacement(self, key: tuple[int, int, int], old: dict,
                                  new: dict) -> web.Response | None:
        """A 409 if the rank's registered address is still alive; None (and a warning) if it is not."""
        was, now = f"{old['rank_ip']}:{old['rank_port']}", f"{new['rank_ip']}:{new['rank_port']}"
        if await _accepts_connections(old["rank_ip"], old["rank_port"]):
            self.registrations_refused += 1
            msg = (f"{_rank_name(key)} is registered at {was}, which is alive; refusing the registration "
                   f"from {now}")
            logger.error("bootstrap registration rejected: %s", msg)
            return web.Response(status=409, text=msg)
        self.registrations_replaced += 1
        logger.warning("bootstrap: %s re-registered at %s, replacing %s (no longer accepts connections)",
                       _rank_name(key), now, was)
        return None

    async def _get_route(self, request: web.Request) -> web.Response:
        try:
            engine_rank = int(request.query.get("engine_rank", "-1"))
            dp = int(request.query.get("target_dp_group", "-1"))
            pp = int(request.query.get("target_pp_rank", "-1"))
        except ValueError:
            return self._bad("engine_rank, target_dp_group, target_pp_rank must be ints")
        with self._lock:
            if self._layout is None:
                return web.Response(status=404, text="no prefill rank registered yet")
            if engine_rank == -1:
                return web.json_response({**self._layout, "ranks": len(self._ranks)})
            info = self._ranks.get((max(dp, 0), engine_rank, max(pp, 0)))
        if info is None:
            return web.Response(status=404,
                                text=f"prefill rank tp {engine_rank} dp {dp} pp {pp} not registered")
        return web.json_response(info)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
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


def _rank_name(key: tuple[int, int, int]) -> str:
    return f"prefill rank dp {key[0]} tp {key[1]} pp {key[2]}"


class BootstrapError(RuntimeError):
    """The bootstrap server answered with an error that retrying will not fix (e.g. 409)."""


class BootstrapClient:
    """HTTP client for the bootstrap routes; GET answers are cached per bootstrap address. With
    `auth` every request is signed and every answer must carry the server's MAC for that request
    (a 401, or an answer without a valid MAC, is a refusal: `register` raises, look-ups return None)."""

    def __init__(self, timeout: float = 2.0, auth: Authenticator | None = None) -> None:
        self.timeout = timeout
        self._auth = auth
        self._refused_logged: set[str] = set()
        self._layouts: dict[str, dict] = {}
        self._ranks: dict[tuple[str, int, int, int], dict] = {}
        self._unreachable_since: dict[str, float] = {}
        self._lock = threading.Lock()
        # bootstrap traffic stays inside the cluster: never route it through an HTTP proxy
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _request(self, method: str, url: str, body: dict | None = None) -> tuple[int, str]:
        """(status, text); with auth, a refused or unauthenticated answer is (401, why)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        nonce = b""
        if self._auth is not None:
            value, nonce = self._auth.request_header(method, req.selector, data or b"")
            req.add_header(HTTP_HEADER, value)
        addr = urllib.parse.urlsplit(url).netloc
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                status, raw, mac = resp.status, resp.read(), resp.headers.get(HTTP_HEADER)
        except urllib.error.HTTPError as e:
            status, raw, mac = e.code, e.read(), e.headers.get(HTTP_HEADER)
        except OSError:
            with self._lock:
                self._unreachable_since.setdefault(addr, time.monotonic())
            raise
        with self._lock:
            self._unreachable_since.pop(addr, None)
        text = raw.decode(errors="replace")
        if self._auth is not None and status != 401:
            try:
                self._auth.check_response(nonce, status, raw, mac)
            except AuthError as e:
                status, text = 401, (f"the answer is not authenticated ({e}): not this cluster's "
                                     "bootstrap server?")
        if status == 401 and addr not in self._refused_logged:
            if len(self._refused_logged) >= 1024:  # addresses come with requests: keep the memory bounded
                self._refused_logged.clear()
            self._refused_logged.add(addr)
            logger.error("bootstrap server %s: cluster authentication failed: %s", addr, text[:200])
        return status, text

    def unreachable_for(self, bootstrap_addr: str) -> float:
        """Seconds since requests to this server started failing to connect (0 when it answers)."""
        with self._lock:
            since = self._unreachable_since.get(bootstrap_addr)
        return 0.0 if since is None else time.monotonic() - since

    def register(self, bootstrap_addr: str, info: dict) -> None:
        """PUT /route; raises BootstrapError on a rejected registration, OSError if unreachable."""
        status, text = self._request("PUT", f"http://{bootstrap_addr}/route", info)
        if status != 200:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} rejected the registration "
                                 f"({status}): {text}")

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

    def invalidate_rank(self, control_addr: str) -> None:
        """Forget cached answers naming the rank at `control_addr` ("tcp://ip:port"), whichever
        bootstrap server gave them (the rank was declared dead)."""
        with self._lock:
            stale = [k for k, v in self._ranks.items()
                     if f"tcp://{v.get('rank_ip')}:{v.get('rank_port')}" == control_addr]
            for key in stale:
                del self._ranks[key]
                self._layouts.pop(key[0], None)

    def health(self, bootstrap_addr: str) -> bool:
        try:
            return self._request("GET", f"http://{bootstrap_addr}/health")[0] == 200
        except OSError:
            return False
