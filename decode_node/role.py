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
(`finish_requests`) and `on_release` frees its receiver, row, pages and metadata slot. Memory a
prefill rank may still be writing into (the request had preallocated it and its transfer did not
succeed) goes to the quarantine (`decode_node/quarantine.py`) instead, until the room drains.

The received metadata row is a peer value: the receiver checks its first token, cached tokens and
logprobs (`MetadataBuffers.check_row`, through `KVReceiver.check_metadata`) before it reports
Success, so a bad row fails the room on every TP rank alike (the consensus poll), never the forward.

With --disaggregation-local-prefill the node also takes requests that carry no rendezvous at all
(`is_local`; a router sends them while its prefill pool is backed up; a prompt over
--disaggregation-local-prefill-max-tokens is refused with `LOCAL_PREFILL_REFUSED`, which the router
answers by sending it again with a rendezvous): they skip the role's queues,
go to the scheduler's waiting queue and are prefilled here like a colocated node's, in chunks with a
decode step of the running batch between two chunks (`Scheduler.decode_between_chunks`).

Radix cache is off on a decode node (`ServerArgs.radix_cache_enabled`). When KV runs out the
scheduler retracts running requests: a retracted request keeps its tokens (prompt + output so far),
its KV is copied to the host store (`--decode-offload-size`) and freed, and from the scheduler's
waiting queue it gets fresh pages with its KV copied back and decodes on, with no prefill; only if
the store had no room for it is it prefilled again *on this node*. Either way it produces the tokens
it would have produced. `_allocatable_tokens` keeps room for
exactly that, so preallocation never starves running, transferring, waiting or retracted requests.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from common.layers.sampling import skip_draws
from common.memory.req_to_token import ReqToTokenPool
from common.protocol import LOCAL_PREFILL_REFUSED
from common.scheduler.req import FinishStatus, Req
from common.scheduler.scheduler import Scheduler
from decode_node.quarantine import Quarantine, QuarantinedRoom
from decode_node.queues import DecodeRequest, DecodeStage, PreallocQueue, TransferQueue, WaitingQueue
from decode_node.req_pool import DecodeReqToTokenPool
from disaggregation.kv import build_kv_manager, build_metadata
from disaggregation.role import PDRole
from transfer.consensus import poll_and_all_reduce
from transfer.metadata import MetadataAllocator
from transfer.peer_checks import check_bootstrap_addr
from transfer.receiver import DecodeKVManager

logger = logging.getLogger("decode")
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 2048  # --disaggregation-local-prefill-max-tokens


def is_local(req: Req) -> bool:
    """A request with no PD rendezvous (none of bootstrap_host/port/room): it prefills on this node."""
    return req.bootstrap_host is None and req.bootstrap_port is None and req.bootstrap_room is None


class DecodeRole(PDRole):
    role = "decode"
    logger = logger

    def __init__(self, sched: Scheduler, args, tp_rank: int, tp_size: int, prealloc_size: int) -> None:
        self.num_metadata_slots = prealloc_size
        super().__init__(sched, MetadataAllocator(self.num_metadata_slots))
        self.pool: DecodeReqToTokenPool = sched.req_to_token_pool
        self.alloc = sched.allocator
        self.num_reserved_decode_tokens = args.num_reserved_decode_tokens
        self.metadata = build_metadata(self.num_metadata_slots, sched, args.draft_layers)
        self.draft_layers = args.draft_layers
        self.kv_manager = build_kv_manager(DecodeKVManager, args, sched.runner, self.metadata, tp_rank,
                                           tp_size, dp_rank=sched.dp_rank)
        self.bytes_per_page = sched.kv_pool.page_stride  # every layer's K and V of one page
        self.prealloc = PreallocQueue()
        self.transfer = TransferQueue()
        self.waiting = WaitingQueue()
        self.quarantine = Quarantine()
        self.local_prefill = args.disaggregation_local_prefill
        self.local_prefill_max_tokens = args.disaggregation_local_prefill_max_tokens \
            or DEFAULT_LOCAL_PREFILL_MAX_TOKENS
        self.num_local_prefills = 0
        logger.info("decode rank %d/%d ready: backend %s, prealloc budget %d requests, %d reserved decode "
                    "tokens per request", tp_rank, tp_size, args.transfer_backend, prealloc_size,
                    self.num_reserved_decode_tokens)

    @property
    def rank(self):
        """The order of the prealloc and waiting queues: by priority, oldest first among equals (so in arrival
        order when no request names a priority)."""
        return self.sched.priority.rank

    def queue_of(self, t: DecodeRequest):
        return {DecodeStage.PREALLOC: self.prealloc, DecodeStage.TRANSFER: self.transfer,
                DecodeStage.WAITING: self.waiting}[t.stage]

    # ================================================================== admission
    def validate(self, req: Req) -> tuple | None:
        if self.local_prefill and is_local(req):
            n = len(req.origin_input_ids)
            if n > self.local_prefill_max_tokens:  # the router sends it again, with a prefill node
                return 400, (f"a prompt of {n} tokens is over this node's "
                             f"--disaggregation-local-prefill-max-tokens {self.local_prefill_max_tokens}: "
                             "send it with bootstrap_host/bootstrap_port/bootstrap_room (through a "
                             "PD router)"), LOCAL_PREFILL_REFUSED
            return None  # the scheduler's own checks follow, as on a colocated node
        err = super().validate(req)
        if err is not None:
            return err
        bad = check_bootstrap_addr(f"{req.bootstrap_host}:{req.bootstrap_port}")
        if bad:
            return 400, bad
        if self.quarantine.holds_room(req.bootstrap_room):
            return 400, f"bootstrap_room {req.bootstrap_room} is still in use by an aborted transfer"
        return None

    def on_new_request(self, req: Req) -> bool:
        # --disaggregation-local-prefill: prefilled here, from the scheduler's waiting queue
        if is_local(req):
            self.num_local_prefills += 1
            logger.info("rid=%s local prefill: no rendezvous, %d prompt tokens prefilled on "
                        "this node", req.rid, len(req.origin_input_ids))
            return False
        room = int(req.bootstrap_room)
        addr = f"{req.bootstrap_host}:{req.bootstrap_port}"
        conn = self.kv_manager.create_receiver(addr, room)
        conn.check_metadata = functools.partial(self._check_metadata, req)
        conn.traceparent = req.traceparent
        t = DecodeRequest(req=req, room=room, conn=conn)
        self.requests[req.rid] = t
        self.prealloc.add(t)
        logger.info("rid=%s room=%d prealloc: bootstrap %s", req.rid, room, addr)
        return True

    def _check_metadata(self, req: Req, slot: int) -> str | None:
        """The received metadata row's problem for `req`, if any (called by the receiver before Success)."""
        return self.metadata.check_row(slot, self.sched.vocab_size, len(req.origin_input_ids),
                                       logprob=req.return_logprob, top_k=req.top_logprobs_num,
                                       draft=self.draft_layers)

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
        states = [self.pool.state_of(t.row)] if hybrid.has_state else None
        t.conn.init(t.pages[first:], t.metadata_index, state_indices=states)
        t.sent_at = time.monotonic()
        logger.info("rid=%s room=%d transfer: %d pages preallocated, metadata slot %d, "
                    "TransferInfo sent", req.rid, t.room, n_pages, t.metadata_index)
        return True

    # ================================================================== every iteration
    def before_schedule(self) -> None:
        tracked = [*self.prealloc, *self.transfer]
        if tracked:
            polls = self.poll(tracked)
            for t in self.transfer.arrived(polls):
                self.guarded(t, "taking the received KV over", self._on_transferred, t)
            # FCFS (priority first under --schedule-policy priority): the first that does not fit stops the
            # rest
            for t in self.prealloc.resolved(polls, self.rank):
                ready = self.guarded(t, "preallocating", self._preallocate, t)
                if ready is None:  # it failed, the next may fit
                    continue
                if not ready:
                    break
                self.prealloc.move(t, self.transfer)
        if self.quarantine:
            self._drain_quarantine()
        self._admit()

    def _drain_quarantine(self) -> None:
        """Free the memory of quarantined rooms no prefill rank can write into any more (TP consensus)."""
        rooms = list(self.quarantine)
        for q in self.quarantine.release(poll_and_all_reduce(rooms, self.consensus_group)):
            self._free_memory(q.pages, q.row, q.metadata_index)
            logger.info("rid=%s room=%d quarantine over after %.3fs: %d pages, row and metadata slot "
                        "free again", q.rid, q.room, time.monotonic() - q.since, len(q.pages))

    def _free_memory(self, pages: list[int] | None, row: int | None, metadata_index: int | None) -> None:
        if pages:
            self.alloc.free_pages(pages)
        if row is not None:
            self.pool.free(row)
        if metadata_index is not None:
            self.metadata_alloc.free(metadata_index)

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
        if self.draft_layers and float(meta["topk_p"][0]) > 0:  # the prefill node's first draft
            req.draft_token, req.draft_hidden = int(meta["topk_index"][0]), meta["hidden_state"]
        off_grammar = None
        if req.max_new_tokens > 0:
            req.output_ids = [first]
            skip_draws(req.generator, req.sampling, 1)  # the prefill node drew the first token
            # the prefill node sampled it under the same grammar: the matcher here starts from it
            if req.grammar is not None and not req.grammar.accept(first):
                off_grammar = f"the prefill node's first token {first} is outside the request's grammar"
            if req.return_logprob:
                req.output_logprobs = [(meta["logprob_val"], first)]
                if req.top_logprobs_num > 0:
                    k = req.top_logprobs_num
                    req.output_top_logprobs = [list(zip(meta["top_vals"][:k].tolist(),
                                                        meta["top_idxs"][:k].tolist(), strict=True))]
        self.transfer.move(t, self.waiting)
        logger.info("rid=%s room=%d waiting: KV received (%d pages) in %.3fs, first token %d",
                    req.rid, t.room, t.num_pages, latency, first)
        if off_grammar is not None:
            self.sched.finish_requests(req.rid, FinishStatus.abort(off_grammar, 500))

    def _admit(self) -> None:
        """Received requests join the running batch while running slots are free."""
        def can_admit() -> bool:
            return self.sched.get_request_counts()[0] < self.sched.max_running_requests \
                and self.pool.can_promote()

        for t in self.waiting.admit(can_admit, self.rank):
            self.forget(t)
            self.guarded(t, "joining the running batch", self._join, t)

    def _join(self, t: DecodeRequest) -> None:
        req = t.req
        self.pool.promote(req.req_pool_idx)
        if not req.output_ids:  # max_new_tokens 0: nothing to decode
            self.sched.finish_requests(req.rid, FinishStatus({"type": "length", "length": 0}))
            return
        logger.info("rid=%s room=%d running", req.rid, t.room)
        self.sched.add_prebuilt_reqs([req])

    # ================================================================== ending
    def on_release(self, req: Req) -> None:
        t = self.requests.get(req.rid)
        if t is None:
            return
        self.release_conn(t)
        if t.pages is not None:
            # preallocated and not taken over: the TransferInfo may have gone out, and a prefill rank
            # may still be writing into these pages; they wait for the room to drain
            self.quarantine.add(QuarantinedRoom(t.rid, t.room, t.conn, t.pages, t.row, t.metadata_index))
            logger.info("rid=%s room=%d quarantined: %d pages, row %s, metadata slot %s until the "
                        "room drains", t.rid, t.room, len(t.pages), t.row, t.metadata_index)
            t.metadata_index = None
        elif t.row is not None:
            self.pool.free(t.row)
        t.row, t.pages = None, None
        self.forget(t)

    # ================================================================== loop and stats
    def has_work(self) -> bool:
        return bool(self.prealloc or self.transfer or self.waiting or self.quarantine)

    def has_ready_work(self) -> bool:
        return bool(self.waiting)

    def unstarted(self) -> list[str]:
        """The requests that hold no memory yet: no TransferInfo went out, no prefill rank writes for them."""
        return [t.rid for t in self.prealloc if t.pages is None]

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
                # every row, running and preallocated (`req_slots_*` count the running budget's only)
                "req_rows_free": ReqToTokenPool.available_size(self.pool),
                "req_rows_total": self.pool.size,
                "metadata_slots_free": self.metadata_alloc.available(),
                "metadata_slots_total": self.num_metadata_slots,
                "kv_quarantined_pages": self.quarantine.num_pages(),
                "kv_quarantined_rooms": len(self.quarantine),
                "num_local_prefills": self.num_local_prefills,
                **self.pd_stats()}

    def close(self) -> None:
        self.kv_manager.close()


class DecodeScheduler(Scheduler):
    """The scheduler of a decode rank: the common one over a `DecodeReqToTokenPool` (the runner it builds is
    given one; a `runner` passed in must have been), with `DecodeRole` as its hooks."""

    def __init__(self, args, model_dir: str, tp_rank: int = 0, tp_size: int = 1, tp_group=None, *,
                 runner=None, **kw) -> None:
        if runner is None:  # built here, not by the base, so that its request table is the decode's
            from common.runner import ModelRunner

            runner = ModelRunner(args, model_dir, tp_rank, tp_size, tp_group, pp_rank=kw.get("pp_rank", 0),
                                 dp_rank=kw.get("dp_rank", 0), make_req_pool=self.make_req_pool(args))
        super().__init__(args, model_dir, tp_rank, tp_size, tp_group, runner=runner, **kw)
        self.hooks = DecodeRole(self, args, tp_rank, tp_size, self.req_to_token_pool.prealloc_size)
        # a local or re-prefilled prompt never stalls the running batch for long
        self.decode_between_chunks = True

    @classmethod
    def make_req_pool(cls, args):
        """Rows for the running requests and, apart, for those whose KV is on its way."""
        prealloc_size = args.disaggregation_prealloc_size or args.max_running_requests
        return functools.partial(DecodeReqToTokenPool, args.max_running_requests, prealloc_size)
