"""DecodeScheduler: the scheduler of a decode node's TP rank.

A request lives in four stages:

* **prealloc** — its `KVReceiver` is created on arrival and asks the prefill node's bootstrap server
  for the layout and the overlapping prefill ranks (page size, model and layout are checked there).
  Once resolved, and when memory allows (`_allocatable_tokens`, the prealloc row budget of
  `DecodeReqToTokenPool`, a free metadata slot), it gets a request row, the KV pages for its whole
  prompt and a metadata slot, and `init()` sends the `TransferInfo` to the prefill ranks;
* **transfer** — the receiver is polled (`poll_and_all_reduce` over the consensus group, so all TP
  ranks agree); on Success the metadata row's room is checked against the request's room, the first
  token (and its logprobs) is read from it and the metadata slot is freed;
* **waiting** — received, waiting for a running slot: the request joins the running batch as a
  prebuilt request (its KV is already in the pool: no prefill compute);
* **running** — normal decode, streaming.

Radix cache is off on a decode node (`ServerArgs.radix_cache_enabled`). When KV runs out the base
scheduler retracts running requests: a retracted request keeps its tokens (prompt + output so far),
frees its KV, and is prefilled again *on this node* from the waiting queue before it continues, so it
produces the tokens it would have produced. `_allocatable_tokens` keeps room for exactly that, so
preallocation never starves running, transferring, waiting or retracted requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from common.layers.sampling import skip_draws
from common.scheduler.req import Req
from common.scheduler.scheduler import Scheduler
from decode_node.req_pool import DecodeReqToTokenPool
from transfer.base import KVPoll
from transfer.consensus import poll_and_all_reduce
from transfer.metadata import MetadataAllocator, MetadataBuffers
from transfer.node import MAX_TOP_LOGPROBS, PDRole, TransferStats, build_kv_manager

logger = logging.getLogger("decode")


@dataclass
class DecodeTransfer:
    """Transfer state of one request on a decode rank; `row`/`pages`/`metadata_index` are what the
    record still owns (the request takes the row and pages over when the KV has arrived)."""

    req: Req
    receiver: Any
    room: int
    stage: str = "prealloc"  # prealloc -> transfer -> waiting
    row: int | None = None
    pages: list[int] | None = None
    metadata_index: int | None = None
    num_pages: int = 0
    created: float = field(default_factory=time.monotonic)
    sent_at: float | None = None


def failure_reason(poller) -> str:
    """Why a room failed; the consensus may report a failure another TP rank saw first."""
    if poller.poll() == KVPoll.Failed:
        return str(poller.failure_exception())
    return f"room {poller.room}: the transfer failed on another TP rank of this node (see its log)"


class DecodeScheduler(PDRole, Scheduler):
    role = "decode"

    def __init__(self, args, model_dir: str, tp_rank: int = 0, tp_size: int = 1, tp_group=None, *,
                 runner=None, **kw) -> None:
        if runner is None:
            from common.runner import ModelRunner

            runner = ModelRunner(args, model_dir, tp_rank, tp_size, tp_group)
        self.prealloc_size = args.disaggregation_prealloc_size or args.max_running_requests
        old = runner.req_to_token_pool
        runner.req_to_token_pool = DecodeReqToTokenPool(args.max_running_requests, self.prealloc_size,
                                                        old.max_context_len)
        del old
        super().__init__(args, model_dir, tp_rank, tp_size, tp_group, runner=runner, **kw)
        from common.distributed import get_consensus_group

        self.consensus_group = get_consensus_group()
        self.num_reserved_decode_tokens = args.num_reserved_decode_tokens
        self.num_metadata_slots = self.prealloc_size
        self.metadata = MetadataBuffers(self.num_metadata_slots, max_top_logprobs=MAX_TOP_LOGPROBS)
        self.metadata_alloc = MetadataAllocator(self.num_metadata_slots)
        self.kv_manager = build_kv_manager(args, self.runner, self.metadata, tp_rank, tp_size, "decode")
        self.transfers: dict[str, DecodeTransfer] = {}
        self.prealloc_queue: list[Req] = []
        self.transfer_queue: list[Req] = []
        self.prebuilt_queue: list[Req] = []
        self.rooms: dict[int, str] = {}
        kv = self.kv_pool
        self.bytes_per_page = 2 * len(kv.layer_ids) * kv.page_bytes
        # statistics
        self.transfer_stats = TransferStats()
        logger.info("decode rank %d/%d ready: backend %s, prealloc budget %d requests, %d reserved decode "
                    "tokens per request", tp_rank, tp_size, args.transfer_backend, self.prealloc_size,
                    self.num_reserved_decode_tokens)

    # ================================================================== admission
    def add_new_request(self, req: Req) -> None:
        room = int(req.bootstrap_room)
        addr = f"{req.bootstrap_host}:{req.bootstrap_port}"
        receiver = self.kv_manager.create_receiver(addr, room)
        self.transfers[req.rid] = DecodeTransfer(req, receiver, room)
        self.rooms[room] = req.rid
        self.prealloc_queue.append(req)
        logger.info("rid=%s room=%d prealloc: bootstrap %s", req.rid, room, addr)

    # ================================================================== memory budget
    def _headroom(self, r: Req) -> int:
        return min(max(r.max_new_tokens - len(r.output_ids), 0), self.num_reserved_decode_tokens)

    def _allocatable_tokens(self) -> int:
        """Free KV tokens preallocation may take: what is free minus the decode headroom of every
        running, transferring and waiting request (retracted ones need their whole sequence back),
        or, if larger, what the biggest running request needs to go on alone after retraction."""
        running = self.running_batch.reqs
        reserve = sum(self._headroom(r) for r in running)
        reserve += sum(self._headroom(r) for r in self.transfer_queue + self.prebuilt_queue)
        back = list(self.waiting_queue) + ([self.chunked_req] if self.chunked_req is not None else [])
        reserve += sum(r.seqlen - r.kv_len + self._headroom(r) for r in back)
        single = 0
        if running:
            retractable = sum(r.kv_len for r in running)
            single = max(r.seqlen + self._headroom(r) for r in running) - retractable
        return self.allocator.available_size() - max(reserve, single)

    def _holds_nothing(self) -> bool:
        return not (self.running_batch.reqs or self.transfer_queue or self.prebuilt_queue or self.waiting_queue
                    or self.chunked_req is not None)

    def _preallocate(self, req: Req, t: DecodeTransfer) -> bool:
        """Reserve row, pages and metadata slot and send the TransferInfo; False if it must wait."""
        pool: DecodeReqToTokenPool = self.req_to_token_pool
        n_pages = -(-len(req.origin_input_ids) // self.page_size)
        if pool.prealloc_available() <= 0 or self.metadata_alloc.available() <= 0:
            return False
        if n_pages > self.allocator.available_pages():
            return False
        need = n_pages * self.page_size + self._headroom(req)
        if need > self._allocatable_tokens() and not self._holds_nothing():
            return False
        t.row = pool.alloc_prealloc()
        t.pages = self.allocator.alloc_pages(n_pages)
        t.num_pages = n_pages
        t.metadata_index = self.metadata_alloc.alloc()
        # sliding window: only the window's pages arrive; hybrid: the row's state slot receives the state
        hybrid = self.runner.hybrid
        first = hybrid.first_sent_page(len(req.origin_input_ids), self.page_size)
        states = [int(pool.row_state[t.row])] if hybrid.has_state else None
        t.receiver.init(t.pages[first:], t.metadata_index, state_indices=states)
        t.stage = "transfer"
        t.sent_at = time.monotonic()
        logger.info("rid=%s room=%d transfer: %d pages preallocated, metadata slot %d, TransferInfo sent", req.rid,
                    t.room, n_pages, t.metadata_index)
        return True

    # ================================================================== queues
    def has_pending_work(self) -> bool:
        return bool(self.prealloc_queue or self.transfer_queue or self.prebuilt_queue)

    def recv_requests(self, timeout_ms: int) -> list:
        # only transfers to wait for: block briefly instead of spinning on the CPU the forwards need
        if timeout_ms == 0 and not (self.waiting_queue or self.running_batch.reqs or self.chunked_req
                                    or self.prebuilt_queue):
            timeout_ms = 2
        return super().recv_requests(timeout_ms)

    def process_queues(self) -> None:
        tracked = self.prealloc_queue + self.transfer_queue
        if tracked:
            polls = poll_and_all_reduce([self.transfers[r.rid].receiver for r in tracked], self.consensus_group)
            resolved = []
            for req, poll in zip(tracked, polls, strict=True):
                t = self.transfers.get(req.rid)
                if t is None:
                    continue
                if poll == KVPoll.Failed:
                    self._fail(req, t, failure_reason(t.receiver))
                elif t.stage == "transfer" and poll == KVPoll.Success:
                    self._on_transferred(req, t)
                elif t.stage == "prealloc" and poll >= KVPoll.WaitingForInput:
                    resolved.append((req, t))
            for req, t in resolved:  # FCFS: the first that does not fit stops the rest
                if not self._preallocate(req, t):
                    break
                self.prealloc_queue.remove(req)
                self.transfer_queue.append(req)
        self._admit_prebuilt()

    def _on_transferred(self, req: Req, t: DecodeTransfer) -> None:
        slot = t.metadata_index
        if self.kv_manager.moves_bytes and self.metadata.get_room(slot) != t.room:
            self._fail(req, t, f"metadata room mismatch: slot {slot} holds room {self.metadata.get_room(slot)}, "
                               f"expected {t.room}")
            return
        meta = self.metadata.get_buf(slot)
        self.metadata_alloc.free(slot)
        t.metadata_index = None
        latency = time.monotonic() - (t.sent_at or t.created)
        self.transfer_stats.success(t.num_pages * self.bytes_per_page, latency)
        # the request takes over the row and the pages
        n = len(req.origin_input_ids)
        ps = self.page_size
        pages = torch.tensor(t.pages, dtype=torch.int64)
        slots = (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)).flatten()[:n]
        self.req_to_token_pool.write(t.row, 0, slots)
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
        self.transfer_queue.remove(req)
        t.stage = "waiting"
        self.prebuilt_queue.append(req)
        logger.info("rid=%s room=%d waiting: KV received (%d pages) in %.3fs, first token %d", req.rid, t.room,
                    t.num_pages, latency, first)

    def _admit_prebuilt(self) -> None:
        pool: DecodeReqToTokenPool = self.req_to_token_pool
        while self.prebuilt_queue and self.num_running_slots_used() < self.max_running_requests \
                and pool.can_promote():
            req = self.prebuilt_queue.pop(0)
            t = self.transfers.pop(req.rid)
            if self.rooms.get(t.room) == req.rid:
                del self.rooms[t.room]
            pool.promote(req.req_pool_idx)
            if not req.output_ids:  # max_new_tokens 0: nothing to decode
                req.finish({"type": "length", "length": 0})
                self.finish_req(req)
                self.collect_update(req)
                continue
            logger.info("rid=%s room=%d running", req.rid, t.room)
            self.add_prebuilt_reqs([req])

    def _fail(self, req: Req, t: DecodeTransfer, reason: str) -> None:
        self.transfer_stats.failures += 1
        logger.warning("rid=%s room=%d transfer failed at stage %s: %s", req.rid, t.room, t.stage, reason)
        req.finish({"type": "abort", "message": f"KV transfer failed: {reason}"}, error_status=500)
        self.abort_request(req.rid, f"KV transfer failed: {reason}")

    # ================================================================== finishing
    def abort_in_extra_queues(self, req: Req, message: str) -> bool:
        for q in (self.prealloc_queue, self.transfer_queue, self.prebuilt_queue):
            if req in q:
                q.remove(req)
                return True
        return False

    def release_req(self, req: Req) -> None:
        t = self.transfers.pop(req.rid, None)
        if t is not None:
            if t.receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                t.receiver.abort()
            if t.pages:
                self.allocator.free_pages(t.pages)
            if t.row is not None:
                self.req_to_token_pool.free(t.row)
            if t.metadata_index is not None:
                self.metadata_alloc.free(t.metadata_index)
            if self.rooms.get(t.room) == req.rid:
                del self.rooms[t.room]
            t.row, t.pages, t.metadata_index = None, None, None
        super().release_req(req)

    # ================================================================== stats
    def queue_counts(self) -> dict[str, int]:
        return {"prealloc": len(self.prealloc_queue), "transfer": len(self.transfer_queue),
                "waiting": len(self.prebuilt_queue) + len(self.waiting_queue)
                + (1 if self.chunked_req is not None else 0),
                "running": len(self.running_batch.reqs)}

    def get_stats(self) -> dict[str, Any]:
        s = super().get_stats()
        pool: DecodeReqToTokenPool = self.req_to_token_pool
        s.update({
            "disaggregation_mode": "decode",
            "num_prealloc_tokens": sum(self.transfers[r.rid].num_pages for r in self.transfer_queue) * self.page_size,
            "prealloc_slots_free": pool.prealloc_available(),
            "prealloc_slots_total": pool.prealloc_size,
            "metadata_slots_free": self.metadata_alloc.available(),
            "metadata_slots_total": self.num_metadata_slots,
            **self.transfer_stats.as_stats(),
        })
        return s

    def close(self) -> None:
        self.kv_manager.close()
