"""The router's one client to the nodes: the generation legs and the aborts, over a keep-alive pool per worker
(router/upstream.py, leaner than aiohttp's client on this hot path), each hop with the node key. The app's
aiohttp session serves the rest: health checks, loads, worker info, admin fan-outs.

A leg is counted on its worker while it runs (`Worker.active`, `requests`) and judged when it ends, for the
worker's circuit breaker (`router.retry.count_answer`); a stream's decode leg is counted and judged by the
relay (router/relay.py), when its stream ends. Every leg task and every abort is held in
`background` until it ends, so nothing is collected while it runs, a leg the relay stopped waiting for
included. `abandon` stops waiting for a leg that was fine and aborts it on its node (an orphan, counted);
`abort` tells a node to drop a leg that failed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import NamedTuple

import msgspec

from common.protocol import ERR_TYPE_HEADER
from common.server.security import bearer_header, client_ssl_context
from router.config import RouterConfig
from router.metrics import Metrics
from router.registry import Worker
from router.retry import Failure, count_answer, count_broken, header_value
from router.upstream import Pool, Response

log = logging.getLogger("router.legs")
LEG_ERRORS = (OSError, TimeoutError)  # what a pool's request or read raises when the worker fails
ABORT_TIMEOUT = 10.0
_ERR_TYPE = ERR_TYPE_HEADER.lower()  # router.upstream keeps header names lower-case


class LegAnswer(NamedTuple):
    """A worker's whole answer to one leg."""

    status: int
    body: bytes
    content_type: str | None
    retry_after: str | None
    err_type: str | None  # the cause the node named (`ERR_TYPE_HEADER`)

    @classmethod
    def of(cls, resp: Response, body: bytes) -> LegAnswer:
        h = resp.headers
        return cls(resp.status, body, h.get("content-type"), h.get("retry-after"), h.get(_ERR_TYPE))


def failure_of(task: asyncio.Future, w: Worker | None, leg: str) -> Failure | None:
    """The Failure a finished leg ended in, None when the worker answered below 300."""
    exc = task.exception()
    if exc is not None:
        return Failure.broken(exc, leg, w)
    a = task.result()
    if a.status >= 300:
        return Failure.answer(a.status, leg, w, a.body, a.content_type, a.retry_after, a.err_type)
    return None


class Legs:
    def __init__(self, cfg: RouterConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        # every hop to a node carries the node key (without one: the client key, added per request)
        self.node_key = cfg.resolved_keys.outgoing()
        self.auth = bearer_header(self.node_key)
        self.ssl_context = None
        self.pools: dict[str, Pool] = {}
        self.background: set[asyncio.Future] = set()

    # ------------------------------------------------------------------ connections

    def pool(self, w: Worker) -> Pool:
        pool = self.pools.get(w.url)
        if pool is None:
            if w.url.startswith("https://") and self.ssl_context is None:
                self.ssl_context = client_ssl_context(self.cfg.ssl_ca_certs)
            pool = self.pools[w.url] = Pool(w.url, self.cfg.request_timeout_secs, self.auth,
                                            ssl_context=self.ssl_context,
                                            connect_timeout=self.cfg.worker_connect_timeout_secs)
        return pool

    def cut_off(self, w: Worker) -> None:
        """`w` failed its health checks: break its connections, so the requests it holds fail now (and are
        retried where nothing reached the client yet) instead of waiting on a peer that is gone."""
        pool = self.pools.get(w.url)
        n = pool.abort_all() if pool is not None else 0
        if n:
            log.warning("%d requests on %s cut off: it failed its health checks", n, w.url)

    def forget(self, urls: set[str]) -> None:
        """Close the connection pools of workers that are no longer registered."""
        for url in list(self.pools):
            if url not in urls:
                self.pools.pop(url).close()

    def hold(self, task: asyncio.Future) -> asyncio.Future:
        """Keep `task` referenced until it ends."""
        self.background.add(task)
        task.add_done_callback(self._release)
        return task

    def _release(self, task: asyncio.Future) -> None:
        self.background.discard(task)
        if not task.cancelled():
            task.exception()  # an abandoned leg's error is nobody's to hear: not logged as never retrieved

    async def idle_bound(self, aw):
        """`aw`, failing with TimeoutError when the worker sends nothing for --stream-idle-timeout-secs."""
        idle = self.cfg.stream_idle_timeout_secs
        return await (asyncio.wait_for(aw, idle) if idle > 0 else aw)

    # ------------------------------------------------------------------ legs

    def headers(self, request, request_id: str, traceparent: str | None) -> bytes:
        """The raw header lines both legs of a request carry: its id, the router's span (--enable-trace),
        and, on a router without a node key, the client's own credentials."""
        headers = b"X-Request-ID: " + header_value(request_id) + b"\r\n"
        if traceparent:
            headers += b"traceparent: " + header_value(traceparent) + b"\r\n"
        if not self.node_key:
            auth = request.headers.get("Authorization")
            if auth:
                headers += b"Authorization: " + header_value(auth) + b"\r\n"
        return headers

    def send(self, w: Worker | None, path: str, payload: bytes, headers: bytes) -> asyncio.Future:
        """A leg whose whole answer is read (a `LegAnswer`), counted on `w` until it ends. With no worker (the
        decode worker prefills the request itself) a leg already answered, with nothing to merge, so an
        attempt reads the same either way."""
        loop = asyncio.get_running_loop()
        if w is None:
            answered = loop.create_future()
            answered.set_result(LegAnswer(200, b"", None, None, None))
            return answered
        w.active += 1
        w.requests += 1
        task = loop.create_task(self._fetch(w, path, payload, headers))
        task.add_done_callback(functools.partial(self._judge, w))
        return self.hold(task)

    async def _fetch(self, w: Worker, path: str, payload: bytes, headers: bytes) -> LegAnswer:
        resp = await self.pool(w).request(path, payload, headers)
        try:
            return LegAnswer.of(resp, await resp.read())
        except BaseException:
            resp.close()
            raise

    @staticmethod
    def _judge(w: Worker, task: asyncio.Future) -> None:
        w.active -= 1
        if task.cancelled():
            return
        if task.exception() is not None:
            count_broken(w)
        else:
            count_answer(w, task.result().status, task.result().err_type)

    async def open_stream(self, w: Worker, path: str, payload: bytes, headers: bytes) -> Response:
        """A streamed leg's response once its status and headers are in (its body read with `read`); the
        caller counts it on `w`."""
        return await self.idle_bound(self.pool(w).request(path, payload, headers))

    async def read(self, resp: Response) -> bytes:
        """A stream's next bytes (b"" at its end), bounded by --stream-idle-timeout-secs."""
        return await self.idle_bound(resp.readany())

    # ------------------------------------------------------------------ aborts

    def abort(self, w: Worker, rids: list[str]) -> None:
        """Ask `w` to drop the requests `rids` (in the background)."""
        self.hold(asyncio.get_running_loop().create_task(self._abort(w, rids)))

    async def _abort(self, w: Worker, rids: list[str]) -> None:
        for rid in rids:
            try:
                resp = await self.pool(w).request("/abort_request", msgspec.json.encode({"rid": rid}),
                                                  timeout=ABORT_TIMEOUT)
                await resp.read()
            except LEG_ERRORS as e:
                log.warning("abort of %s on %s failed: %s", rid, w.url, e)

    def abandon(self, task: asyncio.Future, w: Worker | None, rids: list[str], force: bool = False) -> None:
        """Stop waiting for a leg that has not ended (or, with `force`, that ended but whose request may still
        run on its node) and abort it there, so no orphan waits for its timeout."""
        if w is None or (task.done() and not force):
            return
        task.cancel()
        self.metrics.orphan_aborts += 1
        self.abort(w, rids)
