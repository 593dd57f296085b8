"""The front end's side of a node: the requests it sends to its scheduler, and what comes back.

`TokenizerManager` is the one object the HTTP handlers use. Its parts, each in its own module:

* the tokenizer's work on client input (`common/server/prompt_input.py`, the base class): prompt
  ids and sampling parameters out of text, token ids or chat messages, each check raising
  `BadRequest` naming the field, large inputs handled on a thread pool off the event loop;
* the ZMQ sockets to the scheduler ranks (`common/server/scheduler_link.py`);
* one `ReqState` per request (`common/server/request_state.py`), which the handlers read;
* aborts that came before their request (`common/server/early_aborts.py`).

What this module does with them:

* `submit` registers the request states and sends them to scheduler rank 0 of the DP group each is
  for (`common/server/data_parallel.py`; one group unless --dp-size). It refuses (`QueueFull`, HTTP
  429) requests that would bring what is in the pipe to the scheduler and not yet admitted by it
  past --max-queued-requests; the scheduler admits or refuses (429) each request against its queues
  (`common/scheduler/intake.py: Admission`) and names the rids it admitted;
* a background task reads `BatchOut`/`StatsReport` and updates the states: output ids, incremental
  text (a long update detokenized on the pool), logprobs, finish reason; `wait` returns when one
  state of an HTTP call changed;
* `abort`, --request-timeout (`_expire`, HTTP 504) and a dead scheduler (`mark_dead`, 503) end
  requests early;
* `release` ends a request's life in the front end: a request that has not finished (its HTTP
  client went away, the handler failed) is aborted in the scheduler so its memory is freed; the
  request is counted in the metrics and logged in one line;
* queries (`stats`, `flush_cache`) go to every group; their answers are merged into one;
* `switch_role` asks every group to drain and serve the other PD role (common/scheduler/role_switch.py)
  and refuses new requests (`RoleSwitching`, HTTP 503 naming `ROLE_SWITCH`) until all of them do.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from typing import Any

import msgspec

from common import sampling_defaults
from common.protocol import (
    AbortRequest,
    BadRequest,
    BatchOut,
    FlushCacheRequest,
    StatsQuery,
    StatsReport,
    SwitchRole,
    TokenizedRequest,
    ToScheduler,
    Wake,
)
from common.server.data_parallel import DPGroups, merge_stats
from common.server.detokenizer import special_token_ids
from common.server.early_aborts import EarlyAborts
from common.server.metrics import Metrics
from common.server.prompt_input import INLINE_DETOKENIZE_TOKENS, PromptInput
from common.server.request_state import ReqState
from common.server.scheduler_link import SchedulerLink, ServiceUnavailable
from common.tracing import incoming_traceparent

logger = logging.getLogger("server")


class QueueFull(RuntimeError):
    """--max-queued-requests is reached: HTTP 429 with Retry-After."""


class RoleSwitching(ServiceUnavailable):
    """The node is switching its role: HTTP 503 with `ROLE_SWITCH`, which a router runs again elsewhere."""


class TokenizerManager(PromptInput):
    def __init__(self, args, model_dir: str, to_scheduler: str | list[str], from_scheduler: str,
                 metrics: Metrics | None = None, tokenizer=None):
        """`to_scheduler`: the address of each DP group's rank 0 (one string for a single group)."""
        self.args = args
        self.model_dir = model_dir
        self.tokenizer_path = args.tokenizer or model_dir
        template = None
        if getattr(args, "chat_template", None):
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        if tokenizer is None:
            from common.server.tokenizer_load import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_path, template)
        elif template is not None:
            tokenizer.chat_template = template
        super().__init__(tokenizer, args.context_length or 0,
                         sampling_defaults.load(model_dir, args.sampling_defaults))
        self.special_ids = special_token_ids(tokenizer)
        self.metrics = metrics or Metrics()
        # filled from the scheduler's ready message by configure()
        self.node_info: dict[str, Any] = {}
        addrs = [to_scheduler] if isinstance(to_scheduler, str) else list(to_scheduler)
        self.groups = DPGroups(len(addrs))
        self.queue_limit = args.queued_requests_limit * len(addrs)  # --max-queued-requests per group
        self.pending: set[str] = set()  # rids sent to the scheduler, neither admitted nor finished yet
        self.queue_full_refused = 0  # requests answered 429 here (the scheduler counts its own)
        self.tracer = None  # common.tracing.Tracer with --enable-trace (set by launch)
        self.link = SchedulerLink(addrs, from_scheduler)
        self.wake_groups = bool(getattr(args, "enable_dp_attention", False)) and len(addrs) > 1
        self.states: dict[str, ReqState] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._qids = itertools.count(1)
        self._recv_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self._early_aborts = EarlyAborts()
        self.early_aborts_applied = 0  # requests ended on arrival by an abort that came first
        self.switching: str | None = None  # the role a switch in progress goes to
        self.switches = 0

    # ------------------------------------------------------------------ lifecycle
    def configure(self, ready: dict[str, Any], groups: list[dict[str, Any]] | None = None) -> None:
        """From rank 0's ready message (and with several DP groups, each group's rank 0's: the node's KV
        tokens and running requests are their sums)."""
        self.node_info = dict(ready)
        if groups and len(groups) > 1:
            for key in ("max_total_tokens", "max_running_requests"):
                self.node_info[key] = sum(int(g.get(key) or 0) for g in groups)
        self.context_length = int(ready.get("context_length") or self.context_length)
        mc = ready.get("model_config") or {}
        if mc.get("vocab_size"):
            self.vocab_size = int(mc["vocab_size"])

    def wait_connected(self, timeout: float) -> bool:
        """True once every DP group's first rank has connected to the front end."""
        return self.link.wait_connected(timeout)

    async def start(self) -> None:
        self._recv_task = asyncio.create_task(self._recv_loop(), name="tokenizer-manager-recv")

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):
                pass
        self.close_sockets()

    def close_sockets(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def mark_dead(self, reason: str) -> None:
        """A scheduler process died: fail every live request with 503, refuse new ones."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.metrics.healthy.set(0)
        for st in list(self.states.values()):
            if not st.finished:
                self._finish(st, {"type": "abort", "message": reason}, 503)
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailable(reason))

    # ------------------------------------------------------------------ from the scheduler
    def _send(self, msg: ToScheduler, dp_rank: int = 0) -> None:
        if self.dead_reason is not None:
            raise ServiceUnavailable(self.dead_reason)
        self.link.send(msg, dp_rank)
        if self.wake_groups and isinstance(msg, TokenizedRequest):  # DP attention: the groups step together
            for rank in range(self.link.size):
                if rank != dp_rank:
                    self.link.send(Wake(), rank)

    async def _recv_loop(self) -> None:
        while True:
            try:
                data = await self.link.recv()
            except asyncio.CancelledError:
                raise
            except OSError as e:
                # nothing more can arrive: every live request would wait forever
                logger.error("receiving from the scheduler failed: %s", e)
                self.mark_dead(f"the front end lost its scheduler (receive failed: {e})")
                return
            try:
                msg = self.link.decode(data)
            except msgspec.DecodeError as e:
                logger.error("undecodable message from the scheduler: %s", e)
                continue
            if isinstance(msg, BatchOut):
                await self._on_batch(msg)
            elif isinstance(msg, StatsReport):
                fut = self._queries.pop(msg.qid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)

    async def _on_batch(self, msg: BatchOut) -> None:
        for rid in msg.admitted:
            self.pending.discard(rid)
            st = self.states.get(rid)
            if st is not None and not st.admitted:
                st.admitted = True
                st.notify.set()
        for u in msg.updates:
            st = self.states.get(u.rid)
            if st is not None and not st.finished:
                try:
                    await self._apply_update(st, u)
                except Exception:
                    logger.exception("rid=%s failed to apply an update", u.rid)
                    if not st.finished:
                        self._finish(st, {"type": "abort", "message": "internal error in the front end"}, 500)

    async def _apply_update(self, st: ReqState, u) -> None:
        new = st.absorb(u, self.metrics)
        if len(new) > INLINE_DETOKENIZE_TOKENS:
            # a long answer at once: decode it on the pool (updates of other requests wait behind it,
            # in order; the event loop does not)
            st.detok_busy = True
            try:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.pool, st.detok.step, new, u.finish_reason)
            finally:
                st.detok_busy = False
            if st.finished:  # ended meanwhile (--request-timeout): that end stands
                return
            new = []
        if u.finish_reason is not None:
            self._finish(st, u.finish_reason, u.error_status, new)
        else:
            st.detok.step(new)
            st.notify.set()

    def _finish(self, st: ReqState, reason: dict[str, Any], error_status: int = 0,
                new_ids: list[int] | None = None) -> None:
        self.pending.discard(st.rid)
        st.finish(reason, error_status, new_ids)

    # ------------------------------------------------------------------ submit / wait / release
    def submit(self, reqs: list[TokenizedRequest], *, endpoint: str = "generate",
               return_text_in_logprobs: bool = False) -> tuple[list[ReqState], asyncio.Event]:
        """Register and send the requests of one HTTP call; they share one notify event."""
        if self.dead_reason is not None:
            raise ServiceUnavailable(self.dead_reason)
        if self.switching is not None:
            raise RoleSwitching(f"this node is switching to the {self.switching} role; send the request to "
                                "another node")
        n = len(reqs)
        if n > self.queue_limit:  # handlers refuse it sooner, naming their field
            raise BadRequest(f"a batch of {n} prompts is more than --max-queued-requests "
                             f"({self.queue_limit})")
        if len(self.pending) + n > self.queue_limit:
            # the scheduler has not taken in what is already in the pipe: do not grow it further
            self.queue_full_refused += n
            what = f"a batch of {n} requests" if n > 1 else "a new request"
            raise QueueFull(f"the node's queue is full: {len(self.pending)} requests wait to be admitted and "
                            f"{what} would pass --max-queued-requests={self.queue_limit}; retry later")
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise BadRequest("`rid` values in one batch must be distinct")
        for rid in rids:
            if rid in self.states:
                raise BadRequest(f"`rid` {rid!r} is already in use by a running request")
        notify = asyncio.Event()
        states = []
        now = time.time()
        ranks = self._place(reqs)
        for r, rank in zip(reqs, ranks, strict=True):
            r.arrival_time = r.arrival_time or now
            st = ReqState.create(r, self.tokenizer, self.special_ids, notify, endpoint=endpoint,
                                 return_text_in_logprobs=return_text_in_logprobs, created=now, dp_rank=rank)
            if self.tracer is not None:
                st.span = self.tracer.start("request", incoming_traceparent.get(),
                                            {"pdserve.rid": r.rid, "pdserve.endpoint": endpoint},
                                            start_time=now)
                r.traceparent = self.tracer.traceparent_of(st.span)
            states.append(st)
        early = self._early_aborts.take(rids)
        if early is not None:  # aborted before it arrived: it ends here, the scheduler never sees it
            self.early_aborts_applied += 1
            for st in states:
                self._register(st)
                self._finish(st, {"type": "abort", "message": early})
            logger.info("rid=%s aborted before it arrived (%s)", rids[0], early)
            return states, notify
        for st, r in zip(states, reqs, strict=True):
            self._register(st)
            self.pending.add(st.rid)
            try:
                self._send(r, st.dp_rank)
            except ServiceUnavailable:
                for s in states:
                    self._unregister(s)
                    self.pending.discard(s.rid)
                raise
        timeout = getattr(self.args, "request_timeout", None)
        if timeout:
            loop = asyncio.get_running_loop()
            for st in states:
                st.deadline = loop.call_later(timeout, self._expire, st, timeout)
        return states, notify

    def _place(self, reqs: list[TokenizedRequest]) -> list[int]:
        """The DP group of each request of one HTTP call; numbers the items each group gets as a batch
        of its own (a group admits its items of the call together)."""
        ranks = [self.groups.choose(r.data_parallel_rank) for r in reqs]
        counts = collections.Counter(ranks)
        seen: collections.Counter[int] = collections.Counter()
        for r, rank in zip(reqs, ranks, strict=True):
            r.batch_size, r.batch_index = counts[rank], seen[rank]
            seen[rank] += 1
        return ranks

    def _register(self, st: ReqState) -> None:
        self.states[st.rid] = st
        self.groups.started(st.dp_rank)

    def _unregister(self, st: ReqState) -> None:
        if self.states.pop(st.rid, None) is not None:
            self.groups.ended(st.dp_rank)

    async def wait(self, states: list[ReqState], notify: asyncio.Event) -> None:
        """Return when something changed in one of the states (or at once when all are finished)."""
        if all(s.finished for s in states):
            return
        await notify.wait()
        notify.clear()

    def release(self, st: ReqState, status: int) -> None:
        """The HTTP side is done with this request: abort it if unfinished, count it, log one line."""
        if st.released:
            return
        st.released = True
        if st.deadline is not None:
            st.deadline.cancel()
        if not st.finished:
            try:
                self._send(AbortRequest(rid=st.rid, message="client disconnected"), st.dp_rank)
            except ServiceUnavailable:
                pass
            self._finish(st, {"type": "abort", "message": "client disconnected"})
            status = 499
        self._unregister(st)
        self.pending.discard(st.rid)
        st.count_release(self.metrics, status)
        fr = st.finish_reason or {}
        if st.span is not None:
            self.tracer.end(st.span, {"http.response.status_code": status,
                                      "pdserve.prompt_tokens": st.prompt_tokens,
                                      "pdserve.completion_tokens": st.completion_tokens},
                            error=fr.get("message") if status >= 400 else None)
        logger.info("rid=%s endpoint=%s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                    "latency=%.3fs finish=%s", st.rid, st.endpoint, status, st.prompt_tokens,
                    st.completion_tokens, st.cached_tokens, st.e2e_latency, fr.get("type"))

    # ------------------------------------------------------------------ ending requests early
    def abort(self, rid: str, message: str = "aborted by client") -> bool:
        """Abort a running request in the scheduler (its answer then ends it); an unknown rid's abort is
        kept for its request, in case that is still on its way."""
        st = self.states.get(rid)
        if st is None:
            self._early_aborts.record(rid, message)
            return False
        if st.finished:
            return False
        try:
            self._send(AbortRequest(rid=rid, message=message), st.dp_rank)
        except ServiceUnavailable:
            self._finish(st, {"type": "abort", "message": message})
        return True

    def abort_all(self, message: str = "aborted by abort_all") -> int:
        return sum(self.abort(rid, message) for rid in list(self.states))

    def _expire(self, st: ReqState, timeout: float) -> None:
        """--request-timeout passed: abort the request in the scheduler and answer 504 now, whether or
        not the scheduler still answers (its later updates for this rid are ignored)."""
        if st.finished:
            return
        message = f"request timed out after {timeout:g}s (--request-timeout)"
        logger.warning("rid=%s %s", st.rid, message)
        try:
            self._send(AbortRequest(rid=st.rid, message=message), st.dp_rank)
        except ServiceUnavailable:
            pass
        self._finish(st, {"type": "abort", "message": message}, 504)

    # ------------------------------------------------------------------ queries
    async def _query(self, msg_type, timeout: float) -> list[dict[str, Any]]:
        """Every DP group's answer to one query (`msg_type(qid=...)`), in rank order."""
        loop = asyncio.get_running_loop()
        qids = [next(self._qids) for _ in range(self.link.size)]
        futs = [loop.create_future() for _ in qids]
        self._queries.update(zip(qids, futs, strict=True))
        try:
            for rank, qid in enumerate(qids):
                self._send(msg_type(qid=qid), rank)
            return list(await asyncio.wait_for(asyncio.gather(*futs), timeout))
        except TimeoutError:
            late = [rank for rank, f in enumerate(futs) if not f.done()]
            who = "the scheduler" if len(futs) == 1 else f"DP group(s) {late}"
            raise ServiceUnavailable(f"{who} did not answer within {timeout:.0f}s") from None
        finally:
            for qid in qids:
                self._queries.pop(qid, None)

    async def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        stats = merge_stats(await self._query(StatsQuery, timeout))
        self.metrics.set_stats(stats)
        return stats

    async def flush_cache(self, timeout: float = 30.0) -> dict[str, Any]:
        """Flush every group's prefix cache; `flushed` only when each one did."""
        answers = await self._query(FlushCacheRequest, timeout)
        return {**merge_stats(answers), "flushed": all(a.get("flushed", True) for a in answers)}

    async def switch_role(self, role: str, drain_timeout: float) -> dict[str, Any]:
        """Drain every DP group and have it serve `role`; new requests are refused meanwhile. The caller
        has checked the flags for the new role. A group that does not answer leaves the node in two
        roles, which it cannot serve: it is marked dead (503 on /health)."""
        self.switching = role
        try:
            def ask(qid: int) -> SwitchRole:
                return SwitchRole(qid=qid, role=role, drain_timeout=drain_timeout)

            try:
                answers = await self._query(ask, drain_timeout + 120)
            except ServiceUnavailable as e:
                self.mark_dead(f"a role switch to {role} did not complete: {e}")
                raise
            done = [a for a in answers if a.get("switched")]
            if len(done) < len(answers):
                if done:
                    self.mark_dead(f"a role switch to {role} completed on {len(done)} of {len(answers)} "
                                   "DP groups")
                refused = next(a["error"] for a in answers if not a.get("switched"))
                return {"switched": False, "error": refused}
            self.args = dataclasses.replace(self.args, disaggregation_mode=role)
            self.configure(done[0]["ready"], [a["ready"] for a in done])
            self.switches += 1
            logger.info("role switch to %s done: %d handed back, %d ended at the deadline", role,
                        sum(a["handed_back"] for a in done), sum(a["ended_at_deadline"] for a in done))
            return {"switched": True, "role": role, "seconds": max(a["seconds"] for a in done),
                    "handed_back": sum(a["handed_back"] for a in done),
                    "ended_at_deadline": sum(a["ended_at_deadline"] for a in done)}
        finally:
            self.switching = None
