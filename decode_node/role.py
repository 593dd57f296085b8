"""The decode role of one TP rank: `DecodeRole`, the scheduler's hooks, and `DecodeScheduler`, which
builds a scheduler with them over a `DecodeReqToTokenPool` (the class the node's scheduler processes
are started with).

A request goes prealloc → transfer → waiting → running (`decode_node/queues.py`):
* on arrival (`on_new_request`) its `KVReceiver` is created and it waits in the prealloc queue;
  once the receiver is resolved, and when memory allows (`_allocatable_tokens`, the prealloc row
  budget of `DecodeReqToTokenPool`, a free metadata slot), it gets a request row, the KV pages for
  its whole prompt and a metadata slot, and `init()` sends the `TransferInfo` (first come, first
  served: the first that does not fit stops the rest);
* in the transfer queue the receiver is polled; on Success the metadata row's room is checked, the
  first token (and its logprobs) is read from it, the metadata slot is freed and the request takes
  the row and pages over;
* in the waiting queue it waits for a running slot, then joins the running batch through
  `add_prebuilt_reqs` (no prefill compute) and decodes, streaming.

Every receiver in prealloc and transfer is polled once per iteration (`before_schedule`) with
`poll_and_all_reduce`, so all TP ranks agree; a failure ends the request with HTTP 500
(`finish_requests`) and `on_release` frees its receiver, row, pages and metadata slot.

Radix cache is off on a decode node (`ServerArgs.radix_cache_enabled`). When KV runs out the
scheduler retracts running requests: a retracted request keeps its tokens (prompt + output so far),
frees its KV, and is prefilled again *on this node* from the scheduler's waiting queue before it
continues, so it produces the tokens it would have produced. `_allocatable_tokens` keeps room for
exactly that, so preallocation never starves running, transferring, waiting or retracted requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from common.layers.sampling import skip_draws
from common.scheduler.req import FinishStatus, Req
from common.scheduler.scheduler import Scheduler
from decode_node.queues import DecodeRequest, DecodeStage, PreallocQueue, TransferQueue, WaitingQueue
from decode_node.req_pool import DecodeReqToTokenPool
from transfer.metadata import MetadataAllocator, MetadataBuffers
from transfer.role_common import MAX_TOP_LOGPROBS, PDRole, build_kv_manager

logger = logging.getLogger("decode")


class DecodeRole(PDRole):
    role = "decode"
    logger = logger

    def __init__(self, sched: Scheduler, args, tp_rank: int, tp_size: int, prealloc_size: int) -> None:
        self.num_metadata_slots = prealloc_size
        super().__init__(sched, MetadataAllocator(self.num_metadata_slots))
        self.pool: DecodeReqToTokenPool = sched.req_to_token_pool
        self.alloc = sched.allocator
        self.num_reserved_decode_tokens = args.num_reserved_decode_tokens
        self.metadata = MetadataBuffers(self.num_metadata_slots, max_top_logprobs=MAX_TOP_LOGPROBS)
        self.kv_manager = build_kv_manager(args, sched.runner, self.metadata, tp_rank, tp_size, "decode")
        self.bytes_per_page = sched.kv_pool.page_stride  # every layer's K and V of one page
        self.prealloc = PreallocQueue()
        self.transfer = TransferQueue()
        self.waiting = WaitingQueue()
        logger.info("decode rank %d/%d ready: backend %s, prealloc budget %d requests, %d reserved decode "
                    "tokens per request", tp_rank, tp_size, args.transfer_backend, prealloc_size,
                    self.num_reserved_decode_tokens)

    def queue_of(self, t: DecodeRequest):
        return {DecodeStage.PREALLOC: self.prealloc, DecodeStage.TRANSFER: self.transfer,
                DecodeStage.WAITING: self.waiting}[t.stage]

    # ================================================================== admission
    def on_new_request(self, req: Req) -> bool:
        room = int(req.bootstrap_room)
        addr = f"{req.bootstrap_host}:{req.bootstrap_port}"
        t = DecodeRequest(req=req, room=room, conn=self.kv_manager.create_receiver(addr, room))
        self.requests[req.rid] = t
        self.prealloc.add(t)
        logger.info("rid=%s room=%d prealloc: bootstrap %s", req.rid, room, addr)
        return True

    # ================================================================== memory budget
    def _headroom(self, r: Req) -> int:
        return min(max(r.max_new_tokens - len(r.output_ids), 0), self.num_reserved_decode_tokens)

    def _allocatable_tokens(self) -> int:
        """Free KV tokens preallocation may take: what is free minus the decode headroom of every
        running, transferring and waiting request (retracted ones need their whole sequence back),
        or, if larger, what the biggest running request needs to go on alone after retraction."""
        s = self.sched
        running = s.running_batch.reqs
        reserve = sum(self._headroom(r) for r in running)
        reserve += sum(self._headroom(t.req) for t in [*self.transfer, *self.waiting])
        back = list(s.waiting_queue) + ([s.chunked_req] if s.chunked_req is not None else [])
        reserve += sum(r.seqlen - r.kv_len + self._headroom(r) for r in back)
        single = 0
        if running:
            retractable = sum(r.kv_len for r in running)
            single = max(r.seqlen + self._headroom(r) for r in running) - retractable
        return self.alloc.available_size() - max(reserve, single)

    def _holds_nothing(self) -> bool:
        return not (self.transfer or self.waiting or self.sched.has_unfinished_requests())

    def _preallocate(self, t: DecodeRequest) -> bool:
        """Reserve row, pages and metadata slot and send the TransferInfo; False if it must wait."""
        req = t.req
        n_pages = self.alloc.pages_for(len(req.origin_input_ids))
        if self.pool.prealloc_available() <= 0 or self.metadata_alloc.available() <= 0:
            return False
        if n_pages > self.alloc.available_pages():
            return False
        need = n_pages * self.alloc.page_size + self._headroom(req)
        if need > self._allocatable_tokens() and not self._holds_nothing():
            return False
        t.row = self.pool.alloc_prealloc()
        t.pages = self.alloc.alloc_pages(n_pages)
        t.num_pages = n_pages
        t.metadata_index = self.metadata_alloc.alloc()
        # sliding window: only the window's pages arrive; hybrid: the row's state slot receives the state
        hybrid = self.sched.runner.hybrid
        first = hybrid.first_sent_page(len(req.origin_input_ids), self.alloc.page_size)
        states = [int(self.pool.row_state[t.row])] if hybrid.has_state else None
        t.conn.init(t.pages[first:], t.metadata_index, state_indices=states)
        t.sent_at = time.monotonic()
        logger.info("rid=%s room=%d transfer: %d pages preallocated, metadata slot %d, TransferInfo sent", req.rid,
                    t.room, n_pages, t.metadata_index)
        return True

    # ================================================================== every iteration
    def before_schedule(self) -> None:
        tracked = [*self.prealloc, *self.transfer]
        if tracked:
            polls = self.poll(tracked)
            for t in self.transfer.arrived(polls):
                self._on_transferred(t)
            for t in self.prealloc.resolved(polls):  # FCFS: the first that does not fit stops the rest
                if not self._preallocate(t):
                    break
                self.prealloc.move(t, self.transfer)
        self._admit()

    def _on_transferred(self, t: DecodeRequest) -> None:
        req, slot = t.req, t.metadata_index
        if self.kv_manager.moves_bytes and self.metadata.get_room(slot) != t.room:
            self.fail(t, f"metadata room mismatch: slot {slot} holds room {self.metadata.get_room(slot)}, "
                         f"expected {t.room}")
            return
        meta = self.metadata.get_buf(slot)
        self.metadata_alloc.free(slot)
        t.metadata_index = None
        latency = time.monotonic() - (t.sent_at or t.created)
        self.transfer_stats.success(t.num_pages * self.bytes_per_page, latency)
        # the request takes over the row and the pages
        n = len(req.origin_input_ids)
        self.pool.write(t.row, 0, self.alloc.slots_of_pages(t.pages, n))
        req.req_pool_idx = t.row
        req.kv_len = n
        t.row, t.pages = None, None
        first = meta["first_token_id"]
        req.cached_tokens = meta["cached_tokens"]
        if req.max_new_tokens > 0:
            req.output_ids = [first]
            skip_draws(req.generator, req.sampling, 1)  # the prefill node drew the first token
            if req.return_logprob:
                req.output_logprobs = [(meta["logprob_val"], first)]
                if req.top_logprobs_num > 0:
                    k = req.top_logprobs_num
                    req.output_top_logprobs = [list(zip(meta["top_vals"][:k].tolist(),
                                                        meta["top_idxs"][:k].tolist(), strict=True))]
        self.transfer.move(t, self.waiting)
        logger.info("rid=%s room=%d waiting: KV received (%d pages) in %.3fs, first token %d", req.rid, t.room,
                    t.num_pages, latency, first)

    def _admit(self) -> None:
        """Received requests join the running batch while running slots are free."""
        def can_admit() -> bool:
            return self.sched.get_request_counts()[0] < self.sched.max_running_requests and self.pool.can_promote()

        for t in self.waiting.admit(can_admit):
            self.forget(t)
            req = t.req
            self.pool.promote(req.req_pool_idx)
            if not req.output_ids:  # max_new_tokens 0: nothing to decode
                self.sched.finish_requests(req.rid, FinishStatus({"type": "length", "length": 0}))
                continue
            logger.info("rid=%s room=%d running", req.rid, t.room)
            self.sched.add_prebuilt_reqs([req])

    # ================================================================== ending
    def on_release(self, req: Req) -> None:
        t = self.requests.get(req.rid)
        if t is None:
            return
        self.release_conn(t)
        if t.pages:
            self.alloc.free_pages(t.pages)
        if t.row is not None:
            self.pool.free(t.row)
        t.row, t.pages = None, None
        self.forget(t)

    # ================================================================== loop and stats
    def has_work(self) -> bool:
        return bool(self.prealloc or self.transfer or self.waiting)

    def has_ready_work(self) -> bool:
        return bool(self.waiting)

    def queue_counts(self) -> dict[str, int]:
        s = self.sched
        return {"prealloc": len(self.prealloc), "transfer": len(self.transfer),
                "waiting": len(self.waiting) + len(s.waiting_queue) + (1 if s.chunked_req is not None else 0),
                "running": len(s.running_batch.reqs)}

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": "decode",
                "num_prealloc_tokens": sum(t.num_pages for t in self.transfer) * self.alloc.page_size,
                "prealloc_slots_free": self.pool.prealloc_available(),
                "prealloc_slots_total": self.pool.prealloc_size,
                "metadata_slots_free": self.metadata_alloc.available(),
                "metadata_slots_total": self.num_metadata_slots,
                **self.transfer_stats.as_stats()}

    def close(self) -> None:
        self.kv_manager.close()


class DecodeScheduler(Scheduler):
    """The scheduler of a decode rank: the common one over a `DecodeReqToTokenPool`, with `DecodeRole`
    as its hooks."""

    def __init__(self, args, model_dir: str, tp_rank: int = 0, tp_size: int = 1, tp_group=None, *,
                 runner=None, **kw) -> None:
        if runner is None:
            from common.runner import ModelRunner

            runner = ModelRunner(args, model_dir, tp_rank, tp_size, tp_group)
        prealloc_size = args.disaggregation_prealloc_size or args.max_running_requests
        old = runner.req_to_token_pool
        runner.req_to_token_pool = DecodeReqToTokenPool(args.max_running_requests, prealloc_size,
                                                        old.max_context_len)
        del old
        super().__init__(args, model_dir, tp_rank, tp_size, tp_group, runner=runner, **kw)
        self.hooks = DecodeRole(self, args, tp_rank, tp_size, prealloc_size)
