"""One client request: pick a prefill and a decode worker, send both legs concurrently, relay the decode
leg (streamed as it arrives), merge prompt logprobs from the prefill leg, retry before the client has
received a byte (new room, both legs re-sent, the abandoned leg aborted on its node)."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
import msgspec
from aiohttp import web

from common.protocol import ERR_TYPE_HEADER, KV_TRANSFER_FAILED, LOCAL_PREFILL_REFUSED, error_body
from common.server.security import bearer_header, client_ssl_context
from router.config import RouterConfig
from router.logprobs import PrefillPrompt, StreamMerger, merged_body
from router.metrics import Metrics
from router.policies import Policy
from router.registry import Registry, Worker
from router.request import ParsedRequest, combine, inject, new_rids, rid_list
from router.upstream import Pool

log = logging.getLogger("router.dispatch")

# A worker's answer decides what happens next:
# * 429 (the node's queue is full) goes back to the client as it is, with its Retry-After: no retry (a retry
#   storm is what turns an overloaded cluster into a dead one);
# * 503 and 408 (an overloaded or timed-out node) are retried once, on another worker, when there is one;
# * a worker's own 504 (its --request-timeout passed) goes back as it is: the same deadline would pass
#   again elsewhere, and the worker is not broken;
# * 500, 502, 504 without an answer (the router's timeout) and broken connections (a worker that is
#   broken) are retried up to --retry-max-retries.
# Only the last kind counts as a failure for the worker's circuit breaker, unless the node names a failed KV
# transfer as the cause (`ERR_TYPE_HEADER`); an overload or deadline answer counts as neither a failure nor
# a success.
RETRYABLE = frozenset({500, 502, 504})
RETRY_ONCE = frozenset({408, 503})
OVERLOAD = frozenset({408, 429, 503})
_encode = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"
_ERR_TYPE = ERR_TYPE_HEADER.lower()  # router.upstream keeps header names lower-case
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


# a decode stream's lead event (its first event that carries a token or an error) that is an error: the request
# failed before its first token (a KV transfer that failed, the decode node's own failure), and nothing reached
# the client yet, so it runs again on another pair; an error of another type (the request itself was refused)
# is relayed as it is
_RERUN_TYPES = {"internal_error": 500, "upstream_error": 502, "service_unavailable": 503}


def _preamble(event) -> bool:
    """A token-less event a stream opens with: a chat stream's role chunk (`delta` with its role and empty
    content, no finish reason). The router holds it back until the first token, so that a failure before that
    token leaves the client with nothing and can be run again."""
    if not isinstance(event, dict) or "error" in event or event.get("usage"):
        return False
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for c in choices:
        delta = c.get("delta") if isinstance(c, dict) else None
        if not isinstance(delta, dict) or set(delta) - {"role", "content"} or delta.get("content") \
                or c.get("finish_reason") is not None or c.get("logprobs"):
            return False
    return True


def lead_event(data: bytes) -> tuple[bool, object]:
    """(found, event) for the first whole SSE event of `data` that is neither a comment (a node's keep-alive)
    nor a preamble: found is False while `data` holds no such event yet (read more); the event is its decoded
    JSON, or None for [DONE] or an event that is not JSON."""
    *whole, _rest = data.split(b"\n\n")
    for event in whole:
        lines = [ln for ln in event.split(b"\n") if ln and not ln.startswith(b":")]
        if not lines:
            continue
        if not lines[0].startswith(b"data: ") or lines[0] == b"data: [DONE]":
            return True, None
        try:
            obj = msgspec.json.decode(lines[0][6:])
        except msgspec.DecodeError:
            return True, None
        if not _preamble(obj):
            return True, obj
    return False, None


def _header_value(value: str) -> bytes:
    return value.replace("\r", " ").replace("\n", " ").encode("latin-1", "replace")


def error_response(status: int, message: str, headers=None, code: str | None = None) -> web.Response:
    return web.Response(body=_encode(error_body(status, message, code)), status=status,
                        content_type="application/json", headers=headers)


@dataclass(slots=True)
class Failure:
    """Why an attempt ended before the client got a byte."""

    status: int
    message: str
    worker: Worker | None = None
    body: bytes | None = None
    content_type: str | None = None
    retry_after: str | None = None  # the worker's Retry-After header
    err_type: str | None = None  # the cause the worker named (`ERR_TYPE_HEADER`)

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE and not (self.status == 504 and self.body is not None)

    def response(self, request_id: str) -> web.Response:
        headers = {"X-Request-ID": request_id}
        if self.retry_after is not None:
            headers["Retry-After"] = _header_value(self.retry_after).decode("latin-1")
        elif self.status == 429:
            headers["Retry-After"] = "1"
        if self.body is not None:  # the worker's own answer, status and body preserved
            return web.Response(body=self.body, status=self.status, headers=headers,
                                content_type=(self.content_type or "application/json").split(";")[0])
        return error_response(self.status, self.message, headers=headers)


class LegAnswer(NamedTuple):
    """A worker's whole answer to one leg."""

    status: int
    body: bytes
    content_type: str | None
    retry_after: str | None
    err_type: str | None  # the cause the node named (`ERR_TYPE_HEADER`)


@dataclass(slots=True)
class Trace:
    prefill: str = "-"
    decode: str = "-"
    attempts: int = 0
    status: int = 0
    first_byte: float = 0.0
    traceparent: str | None = None  # the router's span, parent of both legs' spans (--enable-trace)
    events: int = 0  # SSE events relayed to the client (the dashboard's TPOT)
    decode_failed: bool = False  # the decode's stream carried an error event


def leg_failure(status: int, leg: str, w: Worker, body: bytes, ctype: str | None,
                retry_after: str | None = None, err_type: str | None = None) -> Failure:
    """A worker's error answer, passed on as it is, except a refusal of the router's own credentials: the
    client's key was fine, so it gets a 502 that says what to fix, not the worker's 401."""
    if status in (401, 403):
        log.error("%s worker %s refused the router's credentials (%d): check the node key", leg, w.url, status)
        return Failure(502, f"{leg} worker {w.url} refused the router's credentials ({status}); the router's "
                            "node key (--node-api-key-file / PDSERVE_NODE_API_KEY) does not match the worker's", w)
    return Failure(status, f"{leg} worker {w.url} answered {status}", w, body, ctype, retry_after, err_type)


def _any_https(cfg: RouterConfig) -> bool:
    return any(u.startswith("https://") for u in [p.url for p in cfg.prefill] + cfg.decode)


class NoWorkers(Exception):
    pass


class DecodesFull(Exception):
    """Every available decode worker is full (router/capacity.py): a 429, before any leg is sent."""


class LocalPrefill:
    """A request a decode worker prefills itself, counted in its `local_pending` from when it is sent
    until its first event streamed or its leg ended (`done`, once)."""

    def __init__(self, d: Worker) -> None:
        self.worker: Worker | None = d
        d.local_pending += 1
        d.local_prefills += 1

    def done(self) -> None:
        if self.worker is not None:
            self.worker.local_pending -= 1
            self.worker = None


class Dispatcher:
    def __init__(self, cfg: RouterConfig, registry: Registry, session: aiohttp.ClientSession, metrics: Metrics,
                 prefill_policy: Policy, decode_policy: Policy):
        self.cfg = cfg
        self.registry = registry
        self.session = session
        self.metrics = metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.need_text = prefill_policy.needs_text or decode_policy.needs_text
        # every hop to a node (legs, aborts) carries the node key (without one: the client key, as before)
        self.node_key = cfg.resolved_keys.outgoing()
        self.base_headers = {"Content-Type": "application/json", **bearer_header(self.node_key)}
        self.ssl_context = client_ssl_context(cfg.ssl_ca_certs) if _any_https(cfg) else None
        self.background: set[asyncio.Task] = set()
        self.pools: dict[str, Pool] = {}
        self.capacity = None  # router.capacity.DecodeCapacity, set by the app

    # ------------------------------------------------------------------------------ helpers

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    def _keep(self, task: asyncio.Task) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def pick(self, text: str | None, exclude: tuple[Worker, ...], prefill_key=None) -> tuple[Worker, Worker]:
        """A prefill and a decode worker; the prefill policy routes by `prefill_key` when it prepared one."""
        pairs = []
        for workers, kind in ((self.registry.prefill, "prefill"), (self.registry.decode, "decode")):
            ok = [w for w in workers if w.available]
            if not ok:
                raise NoWorkers(f"no available {kind} workers (unhealthy, circuit open or not registered)")
            if kind == "decode" and self.capacity is not None:
                ok = self.capacity.usable(ok)
                if not ok:
                    raise DecodesFull("every decode worker is full (no preallocation row or KV left); retry later")
            if exclude and len(ok) > 1:
                ok = [w for w in ok if w not in exclude] or ok
            pairs.append(ok)
        return (self.prefill_policy.select(pairs[0], text if prefill_key is None else prefill_key),
                self.decode_policy.select(pairs[1], text))

    async def _abort_on(self, w: Worker, rids: list[str]) -> None:
        for rid in rids:
            try:
                async with self.session.post(w.url + "/abort_request", data=_encode({"rid": rid}),
                                             headers=self.base_headers,
                                             timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
            except _UPSTREAM_ERRORS as e:
                log.warning("abort of %s on %s failed: %s", rid, w.url, e)

    def _abandon(self, task: asyncio.Task | None, w: Worker, rids: list[str], force: bool = False) -> None:
        """Stop waiting for a leg and abort it on its node so no orphan waits for its timeout."""
        if task is not None and task.done() and not force:
            return
        if task is not None:
            task.cancel()
        self.metrics.orphan_aborts += 1
        self._spawn(self._abort_on(w, rids))

    @staticmethod
    def _record(w: Worker, status: int, err_type: str | None = None) -> None:
        """A worker's answer, for its circuit breaker: 5xx but an overload answer is a failure."""
        if status in OVERLOAD or status == 504:
            return  # busy, or the request's own deadline passed: not broken
        if err_type == KV_TRANSFER_FAILED:
            return  # the transfer between the nodes failed: the node at fault fails its own leg
        ok = status < 500
        w.breaker.record(ok)
        if not ok:
            w.errors += 1

    @classmethod
    def _leg_done(cls, w: Worker, task: asyncio.Task) -> None:
        w.active -= 1
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            w.errors += 1
            w.breaker.record(False)
        else:
            answer = task.result()
            cls._record(w, answer.status, answer.err_type)

    def _start_leg(self, w: Worker, coro) -> asyncio.Task:
        w.active += 1
        w.requests += 1
        t = asyncio.get_running_loop().create_task(coro)
        t.add_done_callback(functools.partial(self._leg_done, w))
        return t

    def _pool(self, w: Worker) -> Pool:
        pool = self.pools.get(w.url)
        if pool is None:
            if w.url.startswith("https://") and self.ssl_context is None:
                self.ssl_context = client_ssl_context(self.cfg.ssl_ca_certs)
            pool = self.pools[w.url] = Pool(w.url, self.cfg.request_timeout_secs, bearer_header(self.node_key),
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

    async def _fetch(self, w: Worker, path: str, payload: bytes, headers: bytes) -> LegAnswer:
        resp = await self._pool(w).request(path, payload, headers)
        try:
            body = await resp.read()
        except BaseException:
            resp.close()
            raise
        return LegAnswer(resp.status, body, resp.headers.get("content-type"), resp.headers.get("retry-after"),
                         resp.headers.get(_ERR_TYPE))

    async def _open_stream(self, w: Worker, path: str, payload: bytes, headers: bytes):
        """The decode leg's status, its bytes up to and including its lead event (the first with a token or an
        error: `lead_event`), and that event. Until it comes nothing is sent to the client (keep-alives and a
        chat stream's role chunk are held back), so a failure is still run again on another pair; each read is
        bounded by --stream-idle-timeout-secs."""
        resp = await self._idle_bound(self._pool(w).request(path, payload, headers))
        try:
            if resp.status >= 300:
                return resp.status, resp, None, await resp.read(), None
            first = await self._idle_bound(resp.readany())
            found, lead = lead_event(first)
            while first and not found:
                more = await self._idle_bound(resp.readany())
                if not more:
                    break
                first += more
                found, lead = lead_event(first)
            if not found:  # the stream ended before a whole event: nothing but keep-alives, or a cut
                first = b"" if all(not ln or ln.startswith(b":") for ln in first.split(b"\n")) else first
            return resp.status, resp, first, None, lead
        except BaseException:
            resp.close()
            raise

    async def _idle_bound(self, aw):
        """`aw`, failing with TimeoutError when the worker sends nothing for --stream-idle-timeout-secs."""
        idle = self.cfg.stream_idle_timeout_secs
        return await (asyncio.wait_for(aw, idle) if idle > 0 else aw)

    @staticmethod
    def _failure(task: asyncio.Task, w: Worker, leg: str) -> Failure | None:
        exc = task.exception()
        if exc is not None:
            status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            return Failure(status, f"{leg} worker {w.url} failed: {exc!r}", w)
        a = task.result()
        if a.status >= 300:
            return leg_failure(a.status, leg, w, a.body, a.content_type, a.retry_after, a.err_type)
        return None

    def _backoff(self, attempt: int) -> float:
        c = self.cfg
        ms = min(c.retry_initial_backoff_ms * c.retry_backoff_multiplier ** (attempt - 1), c.retry_max_backoff_ms)
        return max(0.0, ms * (1 + random.uniform(-c.retry_jitter_factor, c.retry_jitter_factor)) / 1000)

    # ------------------------------------------------------------------------------ entry point

    async def handle(self, request: web.Request, req: ParsedRequest, request_id: str,
                     trace: Trace) -> web.StreamResponse:
        headers = b"X-Request-ID: " + _header_value(request_id) + b"\r\n"
        if trace.traceparent:
            headers += b"traceparent: " + _header_value(trace.traceparent) + b"\r\n"
        if not self.node_key:  # a router without keys passes the client's own credentials on
            auth = request.headers.get("Authorization")
            if auth:
                headers += b"Authorization: " + _header_value(auth) + b"\r\n"
        failure: Failure | None = None
        exclude: tuple[Worker, ...] = ()
        overload_retried = False
        too_long = False  # a decode worker refused to prefill it (--local-prefill-queue)
        key = await self.prefill_policy.prepare(req) if self.prefill_policy.prepares else None
        for attempt in range(self.cfg.max_attempts):
            if attempt:
                self.metrics.retries += 1
                await asyncio.sleep(self._backoff(attempt))
            trace.attempts = attempt + 1
            try:
                p, d = self.pick(req.text, exclude, key)
            except NoWorkers as e:
                failure = Failure(503, str(e))
                continue
            except DecodesFull as e:
                self.metrics.decodes_full += 1
                failure = Failure(429, str(e), retry_after="1")
                break
            if req.dp_rank is not None and req.dp_rank >= d.dp_size:
                failure = Failure(400, f"`data_parallel_rank` = {req.dp_rank}, but decode worker {d.url} has "
                                       f"{d.dp_size} DP group(s)")
                break
            rids = new_rids(req, attempt, request_id)
            local = not too_long and self.routes_locally(p, d)
            result = await self._attempt(request, req, p, d, key, rids, headers, request_id, trace, local)
            if local and isinstance(result, Failure) and result.err_type == LOCAL_PREFILL_REFUSED:
                # the prompt is longer than the decode worker prefills itself: the same attempt with both legs
                d.local_refused += 1
                too_long = True
                result = await self._attempt(request, req, p, d, key, rids, headers, request_id, trace, False)
            if not isinstance(result, Failure):
                trace.status = result.status
                return result
            failure = result
            if failure.status in RETRY_ONCE:  # an overloaded node: one more try, elsewhere
                retry = not overload_retried and self._other_available(failure.worker)
                overload_retried = True
            else:
                retry = failure.retryable
            if retry and attempt + 1 < self.cfg.max_attempts:
                log.warning("request %s attempt %d failed, retrying: %s", request_id, attempt + 1, failure.message)
            elif failure.status not in OVERLOAD:
                log.warning("request %s attempt %d failed: %s", request_id, attempt + 1, failure.message)
            if not retry:
                break
            # the next attempt goes to another pair where there is one: a failed KV transfer may be either
            # node's (or their link's) doing, and a worker that failed its leg is best avoided at once
            exclude = (p, d)
        trace.status = failure.status
        if failure.status in OVERLOAD and failure.body is not None:
            self.metrics.overload_passed += 1
        return failure.response(request_id)

    async def _attempt(self, request, req, p: Worker, d: Worker, key, rids, headers: bytes, request_id: str,
                       trace: Trace, local: bool):
        """One try on a prefill and a decode worker (on the decode worker alone when `local`): the answer
        relayed to the client, or the Failure that ended it before the client got a byte."""
        held = LocalPrefill(d) if local else None
        if local:
            p = None
        trace.prefill, trace.decode = "local" if p is None else p.url, d.url
        congruences, decode_rank = self._groups(req, key if p is not None else None, p, d)
        payloads = inject(req, p, rids, congruences, decode_rank)[:2]
        try:
            if req.stream:
                return await self._attempt_stream(request, req, p, d, payloads, headers, rids, request_id, trace,
                                                  held)
            return await self._attempt_full(req, p, d, payloads, headers, rids, request_id)
        finally:
            if decode_rank is not None:
                d.dp_end(decode_rank)
            if held is not None:
                held.done()

    def routes_locally(self, p: Worker, d: Worker) -> bool:
        """Conditional disaggregation (--local-prefill-queue N): the decode worker prefills the request
        itself when it takes requests without a rendezvous (--disaggregation-local-prefill) and the prefill
        worker already has N or more of this router's prefills in flight (its queue is where the request
        would wait) for each request the decode worker is already prefilling itself and the one to come:
        N for the first, 2N for a second before the first's first byte, and so on. In steady state that is
        one at a time (its running batch keeps decoding inside the chunks); a burst that finds both idle
        is split between the two queues instead of all but one prompt waiting on the prefill worker
        (`pdserve bench placement`, three rounds: TTFT p99 3.6-4.4 s against 4.7-5.8 s)."""
        n = self.cfg.local_prefill_queue
        return n > 0 and d.prefills_locally and p.active >= n * (d.local_pending + 1)

    def _groups(self, req, key, p: Worker | None, d: Worker) -> tuple[list[tuple[int, int]], int | None]:
        """The DP groups a request goes to, as the (group, dp_size) pairs its room must meet, and the
        decode group with --dp-aware (counted in flight until `dp_end`): the prefill group whose cache
        holds the prompt (`--kv-events`), and the decode group --dp-aware picks among those a room can
        reach together with it (the client's `data_parallel_rank` wins over the cache)."""
        congruences = []
        group = getattr(key, "group", None)
        if group is not None and p.dp_size > 1 and group < p.dp_size:
            congruences.append((group, p.dp_size))
        if not self.cfg.dp_aware:
            return congruences, None
        n = d.dp_size
        allowed = [g for g in range(n) if combine([*congruences, (g, n)]) is not None]
        if req.dp_rank is not None and req.dp_rank not in allowed:
            congruences, allowed = [], list(range(n))
        rank = d.dp_start(req.dp_rank, allowed)
        return [*congruences, (rank, n)], rank

    def _other_available(self, w: Worker | None) -> bool:
        """Whether a worker of `w`'s kind other than `w` can take a request."""
        if w is None:
            return False
        workers = self.registry.prefill if w.kind == "prefill" else self.registry.decode
        return any(x is not w and x.available for x in workers)

    # ------------------------------------------------------------------------------ non-streaming

    def _prefill_leg(self, p: Worker | None, path: str, payload: bytes, headers: bytes) -> asyncio.Future:
        """The prefill leg; with no prefill worker (the decode worker prefills the request itself) a leg
        already answered, with nothing to merge, so an attempt reads the same either way."""
        if p is None:
            answered = asyncio.get_running_loop().create_future()
            answered.set_result(LegAnswer(200, b"", None, None, None))
            return answered
        return self._start_leg(p, self._fetch(p, path, payload, headers))

    async def _attempt_full(self, req, p, d, payloads, headers, rids, request_id):
        path = req.path
        p_task = self._prefill_leg(p, path, payloads[0], headers)
        d_task = self._start_leg(d, self._fetch(d, path, payloads[1], headers))
        ids = rid_list(req, rids)
        try:
            done, _ = await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if p_task in done:
                fail = self._failure(p_task, p, "prefill")
                if fail is not None:
                    self._abandon(d_task, d, ids)
                    return fail
            await asyncio.wait((d_task,))
            fail = self._failure(d_task, d, "decode")
            if fail is not None:
                self._abandon(p_task, p, ids)
                return fail
            status, body, ctype = d_task.result()[:3]
            if req.return_logprob:
                await asyncio.wait((p_task,))
                if p_task.exception() is None and p_task.result()[0] < 300:
                    try:
                        body = merged_body(p_task.result()[1], body)
                    except msgspec.DecodeError:
                        log.warning("request %s: logprobs not merged (a leg's body is not JSON)", request_id)
            elif not p_task.done():
                self._keep(p_task)
            return web.Response(body=body, status=status, headers={"X-Request-ID": request_id},
                                content_type=(ctype or "application/json").split(";")[0])
        except asyncio.CancelledError:  # the client went away
            self.metrics.client_disconnects += 1
            self._abandon(p_task, p, ids)
            self._abandon(d_task, d, ids)
            raise

    # ------------------------------------------------------------------------------ streaming

    async def _attempt_stream(self, request, req, p, d, payloads, headers, rids, request_id, trace, local=None):
        path = req.path
        ids = rid_list(req, rids)
        p_task = self._prefill_leg(p, path, payloads[0], headers)
        d.active += 1
        d.requests += 1
        d_task = asyncio.get_running_loop().create_task(self._open_stream(d, path, payloads[1], headers))
        resp = None
        clean = False
        upstream_broken = False
        try:
            # phase 1: nothing sent to the client yet, any failure may be retried
            pending = {p_task, d_task}
            while d_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if p_task in done:
                    fail = self._failure(p_task, p, "prefill")
                    if fail is not None:
                        if d_task.done() and d_task.exception() is None and d_task.result()[1] is not None:
                            d_task.result()[1].close()
                        self._abandon(d_task, d, ids, force=True)
                        return fail
            if d_task.exception() is not None:
                d.breaker.record(False)
                d.errors += 1
                self._abandon(p_task, p, ids)
                self._spawn(self._abort_on(d, ids))
                return self._failure(d_task, d, "decode")
            status, resp, first, err_body, lead = d_task.result()
            if local is not None:  # its prefill is over: the decode worker may take the next one
                local.done()
            if err_body is not None:
                self._record(d, status, resp.headers.get(_ERR_TYPE))
                self._abandon(p_task, p, ids)
                return leg_failure(status, "decode", d, err_body, resp.headers.get("content-type"),
                                   resp.headers.get("retry-after"), resp.headers.get(_ERR_TYPE))
            early = lead.get("error") if isinstance(lead, dict) else None
            status_of = _RERUN_TYPES.get(early.get("type")) if isinstance(early, dict) else None
            if status_of is not None:  # failed before its first token: nothing sent yet, so run it again
                err_type = KV_TRANSFER_FAILED if early.get("code") == KV_TRANSFER_FAILED else None
                self._record(d, status_of, err_type)
                self._abandon(p_task, p, ids)
                resp.close()
                self.metrics.reruns_before_first_token += 1
                return Failure(status_of, f"decode worker {d.url} failed the request before its first token: "
                                          f"{str(early.get('message'))[:300]}", d, err_type=err_type)
            merger = None
            if req.return_logprob:  # the prompt logprobs come from the prefill leg: wait for its answer
                await asyncio.wait((p_task,))
                fail = self._failure(p_task, p, "prefill")
                if fail is not None:
                    resp.close()
                    self._spawn(self._abort_on(d, ids))
                    return fail
                try:
                    merger = StreamMerger(PrefillPrompt.of(p_task.result()[1]))
                except msgspec.DecodeError:
                    merger = None
            # phase 2: stream to the client; from here errors are SSE events
            out = web.StreamResponse(status=status, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache", "X-Request-ID": request_id})
            await out.prepare(request)
            trace.first_byte = time.perf_counter()
            reason = await self._relay(out, resp, first, merger, trace)
            if reason is None:
                clean = True
                if trace.decode_failed:  # its decode will not take the KV: the prefill leg must not wait for it
                    self._abandon(p_task, p, ids)
            elif reason != "client":
                upstream_broken = True
                self.metrics.stream_errors += 1
                self._abandon(p_task, p, ids)
                self._spawn(self._abort_on(d, ids))
                try:
                    await out.write(b"data: " + _encode(error_body(502, reason)) + b"\n\n" + _DONE)
                except ConnectionError:
                    pass
            else:
                self.metrics.client_disconnects += 1
                self._abandon(p_task, p, ids)
                self._spawn(self._abort_on(d, ids))
            if not p_task.done():
                self._keep(p_task)
            return out
        except asyncio.CancelledError:
            self.metrics.client_disconnects += 1
            self._abandon(p_task, p, ids)
            if not clean:
                self._abandon(d_task, d, ids, force=True)
            raise
        finally:
            d.active -= 1
            if resp is not None:
                if not clean:
                    resp.close()
                if resp.status < 300:
                    d.breaker.record(not upstream_broken)

    async def _relay(self, out, resp, data, merger, trace: Trace) -> str | None:
        """Copy decode bytes to the client. None when the stream ended cleanly, "client" when the client
        went away, else why the stream broke. The relay starts at the decode's first token, when its KV has
        arrived, so the prefill leg's own ending (even a failure: its node died after the transfer, say) no
        longer matters to this stream."""
        tail = b""
        while data:
            if merger is not None:
                data = merger.feed(data)
            if data:
                trace.events += data.count(b"data: ")
                # an error event: the decode's request failed after its stream began (as a JSON key,
                # the quote before `error` is never escaped; the tail covers a key split across reads)
                if b'"error":' in tail + data:
                    trace.decode_failed = True
                # the [DONE] event (at an event's start: JSON escapes newlines, so no text can fake it)
                finished = (b"\n\n" + tail + data if not tail else tail + data).find(b"\n\ndata: [DONE]") >= 0
                tail = data[-16:]
                try:
                    await out.write(data)
                except ConnectionError:
                    return "client"
                if finished:  # the client has the whole answer and may hang up now; the connection goes back
                    # to the pool by itself when the worker's last chunk arrives
                    return None
            try:
                data = await self._idle_bound(resp.readany())
            except TimeoutError:
                return (f"decode worker sent nothing for {self.cfg.stream_idle_timeout_secs:g}s "
                        "(--stream-idle-timeout-secs): presumed gone")
            except _UPSTREAM_ERRORS as e:
                return f"decode leg failed mid-stream: {e!r}"
        if merger is not None and merger.buf:
            try:
                await out.write(merger.buf)
            except ConnectionError:
                return "client"
        return None
