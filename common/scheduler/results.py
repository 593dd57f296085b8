"""ResultProcessor: what a forward's result does to its requests, and how a request ends.

`apply(batch, result)` is the update phase of a step:
* an extend batch: prompt logprobs; a chunk that is not the last goes into the radix cache and the role
  hears `on_chunk_done`; a completed prefill appends its first token, checks stops, tells the role
  (`on_prefill_done`) and joins the running batch (or ends); a mixed chunk's decode rows follow;
* a decode batch: one token per request;
* a verify batch (speculative decoding): each request keeps its confirmed drafts plus the model's own
  next token, up to where it finishes; the KV slots of the rest are given back (`rollback`).

Ending: `finish` (a normal end: the role may hold the request's memory, `held`), `end` (finish requests
now wherever they are: the contract's `finish_requests`), `release_held`, and `release`, which frees or
caches the memory (after the forward in flight that writes it, with overlap scheduling) and forgets
the request. Every piece of news is recorded in the `OutputBatcher` (`report`); a held request's end
waits until its release.

An exception in a per-request hook ends that request with error_status 500 (`hook_failed`).
"""

from __future__ import annotations

import logging
import time

from common.forward_batch import ForwardMode
from common.runner import RunnerOutput
from common.scheduler.batch import ScheduleBatch
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.output import OutputBatcher
from common.scheduler.queues import RequestQueues
from common.scheduler.req import FinishStatus, Req
from common.scheduler.retraction import Retraction
from common.scheduler.speculative import accepted_run, rollback
from common.scheduler.stats import Counters
from common.scheduler.trace import export_stage_spans

logger = logging.getLogger("scheduler")


class ResultProcessor:
    def __init__(self, queues: RequestQueues, runner, counters: Counters, output: OutputBatcher,
                 retraction: Retraction, *, drafter=None, overlap=None, tracer=None) -> None:
        self.queues = queues
        self.runner = runner  # a hybrid model's state keeps the verified tokens' (runner.hybrid)
        self.counters = counters
        self.output = output
        self.retraction = retraction
        self.drafter = drafter
        self.overlap = overlap
        self.tracer = tracer
        running = queues.running_batch
        self.tree_cache = running.tree_cache
        self.allocator = running.allocator
        self.req_to_token_pool = running.req_to_token_pool
        self.hooks = SchedulerHooks()  # the scheduler's `hooks` setter installs the role's

    # ================================================================== a forward's result
    def apply(self, batch: ScheduleBatch, result: RunnerOutput) -> None:
        self.counters.forward_ct += 1
        if batch.mode == ForwardMode.EXTEND:
            self._update_prefill(batch, result)
        else:
            self._update_decode(batch, result)

    def _append_token(self, req: Req, tok: int, logprob: float | None = None, top=None) -> None:
        req.output_ids.append(tok)
        if req.grammar is not None:
            req.accept_grammar(tok)
        if req.return_logprob:
            req.output_logprobs.append((logprob, tok))
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(top or [])
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.counters.total_generated_tokens += 1

    def _update_prefill(self, batch: ScheduleBatch, result: RunnerOutput) -> None:
        n = batch.extend_info.num_prefill
        for i, req in enumerate(batch.reqs[:n]):
            if result.input_logprobs is not None and result.input_logprobs[i] is not None:
                if not req.input_logprobs and req.logprob_start_len == 0:
                    req.input_logprobs.append((None, req.origin_input_ids[0]))
                    req.input_top_logprobs.append(None)
                req.input_logprobs.extend(result.input_logprobs[i])
                tops = result.input_top_logprobs[i]
                req.input_top_logprobs.extend(tops if tops is not None
                                              else [None] * len(result.input_logprobs[i]))
            if not batch.extend_info.completes[i]:
                self.tree_cache.cache_unfinished_req(req)
                try:
                    self.hooks.on_chunk_done(req)
                except Exception:
                    self.hook_failed("on_chunk_done", req)
                continue
            req.input_logprobs_done = True
            if req.finished():  # ended while this batch ran
                continue
            if result.next_token_ids[i] is not None:
                self._append_token(req, result.next_token_ids[i],
                                   result.token_logprobs[i], result.top_logprobs[i])
            req.check_finished()
            try:
                self.hooks.on_prefill_done(req)
            except Exception:
                self.hook_failed("on_prefill_done", req)
                continue
            if req.finished():
                self.finish(req)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.queues.running_batch.merge([req])
                req.mark("decode")
            self.report(req)
        if n < len(batch.reqs):  # a mixed chunk's decode rows
            self._update_decode(batch, result, start=n)

    def _update_decode(self, batch: ScheduleBatch, result: RunnerOutput, start: int = 0) -> None:
        """A decode step's tokens (or a verify step's, or a mixed chunk's decode rows from `start` on)."""
        before = self.counters.total_generated_tokens
        if batch.mode == ForwardMode.VERIFY:
            self._update_verify(batch, result)
        else:
            for i in range(start, len(batch.reqs)):
                req = batch.reqs[i]
                if req.finished():
                    continue
                self._append_token(req, result.next_token_ids[i],
                                   result.token_logprobs[i], result.top_logprobs[i])
                if req.check_finished():
                    self.finish(req)
                self.report(req)
        self.counters.generated_in_step(self.counters.total_generated_tokens - before)
        self.queues.running_batch.filter(lambda r: not r.finished())

    def _update_verify(self, batch: ScheduleBatch, result: RunnerOutput) -> None:
        """Keep each request's confirmed drafts and its own next token, up to where it finishes, and give
        back the KV slots of the rest."""
        kept = []
        for i, (req, drafts) in enumerate(zip(batch.reqs, batch.drafts, strict=True)):
            if req.finished():
                kept.append(0)
                continue
            reserved = req.kv_len
            base = reserved - 1 - len(drafts)  # KV length before this step
            targets = result.next_token_ids[i]
            lps, tops = result.token_logprobs[i], result.top_logprobs[i]
            n = 0
            for j in range(accepted_run(drafts, targets) + 1):
                self._append_token(req, targets[j], lps[j] if lps else None, tops[j] if tops else None)
                n += 1
                if req.check_finished():
                    break
            req.kv_len = base + n
            rollback(req, self.allocator, self.req_to_token_pool, reserved)
            kept.append(n)
        hybrid = getattr(self.runner, "hybrid", None)
        if hybrid is not None:  # recurrent state: the one after each running request's last kept token
            hybrid.keep_verified(batch.forward_batch,
                                 [0 if r.finished() else n for r, n in zip(batch.reqs, kept, strict=True)])
        for req, n in zip(batch.reqs, kept, strict=True):
            if n:
                if req.finished():
                    self.finish(req)
                self.report(req)
        self.drafter.record(batch.reqs, batch.drafts, kept)

    # ================================================================== ending
    def finish(self, req: Req) -> None:
        """A request ended normally: the role may hold it; else release its memory (into the cache)."""
        try:
            hold = self.hooks.on_finished(req)
        except Exception:
            logger.exception("rid=%s on_finished hook failed; the request fails", req.rid)
            req.finished_reason = None
            req.finish({"type": "abort", "message": "internal error in the node's on_finished (see its log)"},
                       error_status=500)
            hold = False
        if hold:
            self.queues.held[req.rid] = req
            return
        self.release(req)
        self.log_finished(req)

    def end(self, request_ids: list[str], status: FinishStatus) -> None:
        """End requests now, wherever they are, free their memory and report their end. Unknown ids
        and requests that already ended are skipped, so ending twice is harmless."""
        abort = status.reason.get("type") == "abort"
        for rid in request_ids:
            req = self.queues.live_reqs.get(rid)
            if req is None:
                continue
            if abort:
                logger.info("rid=%s aborted (%s) at stage %s", rid,
                            status.reason.get("message"), req.stage.value)
                req.to_abort = status.reason.get("message")
            self.queues.dequeue(req)
            req.finish(status.reason, error_status=status.error_status)
            self.release(req)
            if not abort:
                self.log_finished(req)
            self.report(req)

    def release_held(self, rid: str) -> None:
        """The role is done with a request it held after it finished: free its memory, report its end."""
        req = self.queues.held.pop(rid)
        self.release(req)
        self.log_finished(req)
        self.report(req)

    def hook_failed(self, hook: str, req: Req) -> None:
        """A role hook raised for `req` (call from the except block): log it and end that request
        with 500, wherever it is (a reason it had already finished with is replaced)."""
        logger.exception("rid=%s %s hook failed; the request fails", req.rid, hook)
        req.finished_reason = None
        self.end([req.rid], FinishStatus.abort(f"internal error in the node's {hook} (see its log)", 500))

    def release(self, req: Req) -> None:
        """Free (or cache) an ended request's memory, the role's share first, and forget it. Memory
        a forward in flight still writes is freed once that forward is done."""
        if self.overlap is not None and self.overlap.in_flight(req):
            self.overlap.defer(req, self._free_memory)
        else:
            self._free_memory(req)
        self.counters.total_cached_tokens += req.cached_tokens if req.scheduled_once else 0
        self.queues.live_reqs.pop(req.rid, None)
        if self.tracer is not None and req.traceparent:
            export_stage_spans(self.tracer, req)

    def _free_memory(self, req: Req) -> None:
        try:
            self.hooks.on_release(req)
        except Exception:
            logger.exception("rid=%s on_release hook failed; the scheduler frees its own share", req.rid)
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
        elif req.last_node is not None:
            req.last_node = None
        self.retraction.discard(req.rid)

    def report(self, req: Req) -> None:
        """Record the request's news for this iteration's BatchOut (a held request's end waits)."""
        if req.rid not in self.queues.held:
            self.output.add(req)

    @staticmethod
    def log_finished(req: Req) -> None:
        logger.info("rid=%s finished: %s, prompt %d, completion %d, cached %d", req.rid, req.finished_reason,
                    len(req.origin_input_ids), len(req.output_ids), req.cached_tokens)
