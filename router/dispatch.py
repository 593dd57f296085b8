"""One client request through the cluster, read top to bottom in `Dispatcher.handle`:

1. pick a prefill and a decode worker (`pick`: the policies, among the available workers, skipping full
   decodes and, on a retry, the pair that failed);
2. run one attempt on them (router/relay.py: the room and rids injected, both legs sent at once, the decode
   leg relayed to the client as it arrives, the prompt's logprobs merged from the prefill leg);
3. an attempt that failed before the client got a byte is a `Failure`: the retry table (router/retry.py)
   says whether another attempt follows, after a backoff, with a fresh room and fresh rids; the last
   failure is the client's answer.

With --local-prefill-queue a decode worker may prefill a request itself (`routes_locally`): the attempt has
no prefill leg, and a decode worker that refuses the prompt as too long gets the same attempt again with both
legs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web

from common.protocol import LOCAL_PREFILL_REFUSED
from router.config import RouterConfig
from router.legs import Legs
from router.metrics import Metrics
from router.policies import Policy
from router.registry import Registry, Worker
from router.relay import Attempt
from router.request import ParsedRequest, combine, inject, new_rids, rid_list
from router.retry import OVERLOAD, Failure, Kind, Retries

log = logging.getLogger("router.dispatch")


@dataclass(slots=True)
class Trace:
    prefill: str = "-"
    decode: str = "-"
    attempts: int = 0
    status: int = 0
    first_byte: float = 0.0
    traceparent: str | None = None  # the router's span, parent of both legs' spans (--enable-trace)
    events: int = 0  # SSE events relayed to the client (the dashboard's TPOT)


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
    def __init__(self, cfg: RouterConfig, registry: Registry, metrics: Metrics, prefill_policy: Policy,
                 decode_policy: Policy):
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.need_text = prefill_policy.needs_text or decode_policy.needs_text
        self.legs = Legs(cfg, metrics)  # the one client for the legs and their aborts
        self.capacity = None  # router.capacity.DecodeCapacity, set by the app

    async def handle(self, request: web.Request, req: ParsedRequest, request_id: str,
                     trace: Trace) -> web.StreamResponse:
        headers = self.legs.headers(request, request_id, trace.traceparent)
        key = await self.prefill_policy.prepare(req) if self.prefill_policy.prepares else None
        retries = Retries(self.cfg, self.metrics, self._other_available, request_id)
        exclude: tuple[Worker, ...] = ()
        # workers whose leg broke in this request: avoided while others are up
        broken: tuple[Worker, ...] = ()
        too_long = False  # a decode worker refused to prefill it itself (--local-prefill-queue)
        for attempt in range(self.cfg.max_attempts):
            trace.attempts = attempt + 1
            pair = self._pair(req, exclude, broken, key)
            if isinstance(pair, Failure):
                failure = pair
            else:
                p, d = pair
                rids = new_rids(req, attempt, request_id)
                local = not too_long and self.routes_locally(p, d)
                result = await self._attempt(request, req, p, d, key, rids, headers, request_id, trace, local)
                if local and isinstance(result, Failure) and result.err_type == LOCAL_PREFILL_REFUSED:
                    # the prompt is longer than the decode worker prefills itself: the same attempt, both legs
                    d.local_refused += 1
                    too_long = True
                    result = await self._attempt(request, req, p, d, key, rids, headers,
                                                 request_id, trace, False)
                if not isinstance(result, Failure):
                    trace.status = result.status
                    return result
                failure = result
                # a next attempt goes to another pair where there is one: a failed KV transfer may be either
                # node's (or their link's) doing, and a worker that failed its leg is best avoided at once;
                # one whose connection broke (killed, cut off) stays avoided for the rest of the request, as
                # its health checks may not have caught up yet
                exclude = (p, d)
                if failure.kind is Kind.BROKEN and failure.worker is not None \
                        and failure.worker not in broken:
                    broken += (failure.worker,)
            if not await retries.again(failure, attempt):
                break
        trace.status = failure.status
        if failure.status in OVERLOAD and failure.body is not None:
            self.metrics.overload_passed += 1
        return failure.response(request_id)

    # ------------------------------------------------------------------------------ picking the workers

    def pick(self, text: str | None, exclude: tuple[Worker, ...], prefill_key=None,
             broken: tuple[Worker, ...] = ()) -> tuple[Worker, Worker]:
        """A prefill and a decode worker; the prefill policy routes by `prefill_key` when it prepared one.
        A retry avoids the pair it failed on (`exclude`) and every worker whose leg broke (`broken`), or at
        least the broken ones when that leaves no worker of a kind."""
        pairs = []
        for workers, kind in ((self.registry.prefill, "prefill"), (self.registry.decode, "decode")):
            ok = [w for w in workers if w.available]
            if not ok:
                raise NoWorkers(f"no available {kind} workers (unhealthy, circuit open or not registered)")
            if kind == "decode" and self.capacity is not None:
                ok = self.capacity.usable(ok)
                if not ok:
                    raise DecodesFull("every decode worker is full (no preallocation row or KV left); "
                                      "retry later")
            for skip in (exclude + broken, broken):
                rest = [w for w in ok if w not in skip]
                if skip and rest:
                    ok = rest
                    break
            pairs.append(ok)
        return (self.prefill_policy.select(pairs[0], text if prefill_key is None else prefill_key),
                self.decode_policy.select(pairs[1], text))

    def _pair(self, req: ParsedRequest, exclude: tuple[Worker, ...], broken: tuple[Worker, ...],
              key) -> tuple[Worker, Worker] | Failure:
        """`pick`'s pair for this attempt, or the Failure that leaves no pair to try."""
        try:
            p, d = self.pick(req.text, exclude, key, broken)
        except NoWorkers as e:
            return Failure(Kind.NO_WORKERS, 503, str(e))
        except DecodesFull as e:
            self.metrics.decodes_full += 1
            return Failure(Kind.DECODES_FULL, 429, str(e), retry_after="1")
        if req.dp_rank is not None and req.dp_rank >= d.dp_size:
            return Failure(Kind.BAD_REQUEST, 400, f"`data_parallel_rank` = {req.dp_rank}, but decode worker "
                                                  f"{d.url} has {d.dp_size} DP group(s)")
        return p, d

    def _other_available(self, w: Worker) -> bool:
        """Whether a worker of `w`'s kind other than `w` can take a request."""
        workers = self.registry.prefill if w.kind == "prefill" else self.registry.decode
        return any(x is not w and x.available for x in workers)

    def routes_locally(self, p: Worker, d: Worker) -> bool:
        """Conditional disaggregation (--local-prefill-queue N): the decode worker prefills the request
        itself when it takes requests without a rendezvous (--disaggregation-local-prefill) and the prefill
        worker already has N or more of this router's prefills in flight (its queue is where the request
        would wait) for each request the decode worker is already prefilling itself and the one to come:
        N for the first, 2N for a second before the first's first byte, and so on. In steady state that is
        one at a time (its running batch keeps decoding inside the chunks); a burst that finds both idle
        is split between the two queues instead of all but one prompt waiting on the prefill worker."""
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

    # ------------------------------------------------------------------------------ one attempt

    async def _attempt(self, request, req: ParsedRequest, p: Worker, d: Worker, key, rids, headers: bytes,
                       request_id: str, trace: Trace, local: bool) -> web.StreamResponse | Failure:
        """One try on a prefill and a decode worker (on the decode worker alone when `local`): the answer
        relayed to the client, or the Failure that ended it before the client got a byte."""
        held = LocalPrefill(d) if local else None
        prefill = None if local else p
        trace.prefill, trace.decode = "local" if prefill is None else prefill.url, d.url
        congruences, decode_rank = self._groups(req, key if prefill is not None else None, prefill, d)
        payloads = inject(req, prefill, rids, congruences, decode_rank)[:2]
        try:
            return await Attempt(self.legs, self.metrics, req, prefill, d, payloads,
                                 headers, rid_list(req, rids), request_id, trace, held).run(request)
        finally:
            if decode_rank is not None:
                d.dp_end(decode_rank)
            if held is not None:
                held.done()
