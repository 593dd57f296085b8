"""PrefillScheduler: the scheduler of a prefill node's TP rank.

A request lives in three queues:

* **bootstrap** — its `KVSender` (room = `bootstrap_room`) is created on arrival and `init()`-ed once a
  metadata slot is free; it waits there until every overlapping decode rank sent its `TransferInfo`
  (the sender polls `WaitingForInput`);
* **waiting** — the base scheduler's waiting queue: normal prefill scheduling with `PrefillAdder` and
  chunked prefill; `max_new_tokens` is forced to 1 (the first token is all a prefill node samples).
  After every non-final chunk the full pages computed so far are sent; the final chunk writes the
  request's `MetadataBuffers` row (first token, its logprob and top logprobs, cached tokens, room)
  and sends the remaining pages, the partial one included, with `last=True`;
* **inflight** — the sends are in progress; the request keeps its KV (and its radix-cache lock) until
  the transfer polls Success, then its KV goes into the radix cache and its HTTP response (the
  SGLang-native body of the prefill: first token, prompt logprobs when asked) completes. Failed
  ends the request with the reason (HTTP 500).

Every sender in any queue is polled once per iteration with `poll_and_all_reduce` over the consensus
group, so all TP ranks see the same states and move requests in lockstep; a sender that fails
(decode aborted or died, timeout, injected failure) ends its request wherever it is and frees its
KV, its request slot and its metadata slot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from common.scheduler.req import Req
from common.scheduler.scheduler import Scheduler
from prefill_node.kv import start_bootstrap_server
from transfer.base import KVPoll
from transfer.consensus import poll_and_all_reduce
from transfer.metadata import MetadataAllocator, MetadataBuffers
from transfer.node import MAX_TOP_LOGPROBS, PDRole, TransferStats, advertised_host, build_kv_manager

logger = logging.getLogger("prefill")


@dataclass
class PrefillTransfer:
    """Transfer state of one request on a prefill rank."""

    req: Req
    sender: Any
    room: int
    num_pages: int
    stage: str = "bootstrap"  # bootstrap -> waiting -> inflight
    metadata_index: int | None = None
    sent_pages: int = 0
    created: float = field(default_factory=time.monotonic)
    first_send: float | None = None
    first_page: int = 0  # sliding window ("swa"): pages before the window are not sent


def failure_reason(poller) -> str:
    """Why a room failed; the consensus may report a failure another TP rank saw first."""
    if poller.poll() == KVPoll.Failed:
        return str(poller.failure_exception())
    return f"room {poller.room}: the transfer failed on another TP rank of this node (see its log)"


class PrefillScheduler(PDRole, Scheduler):
    role = "prefill"

    def __init__(self, args, model_dir: str, tp_rank: int = 0, tp_size: int = 1, tp_group=None, **kw) -> None:
        super().__init__(args, model_dir, tp_rank, tp_size, tp_group, **kw)
        from common.distributed import get_consensus_group

        self.consensus_group = get_consensus_group()
        # one metadata row per request between bootstrap and the end of its transfer
        self.num_metadata_slots = 2 * self.req_to_token_pool.size + self.max_running_requests
        self.metadata = MetadataBuffers(self.num_metadata_slots, max_top_logprobs=MAX_TOP_LOGPROBS)
        self.metadata_alloc = MetadataAllocator(self.num_metadata_slots)
        self.bootstrap_server = start_bootstrap_server(args) if tp_rank == 0 else None
        self.bootstrap_addr = f"{advertised_host(args.host)}:{args.disaggregation_bootstrap_port}"
        try:
            self.kv_manager = build_kv_manager(args, self.runner, self.metadata, tp_rank, tp_size, "prefill",
                                               bootstrap_addr=self.bootstrap_addr)
        except Exception:
            if self.bootstrap_server is not None:
                self.bootstrap_server.stop()
            raise
        self.transfers: dict[str, PrefillTransfer] = {}
        self.bootstrap_queue: list[Req] = []
        self.inflight_queue: list[Req] = []
        self.rooms: dict[int, str] = {}
        # statistics
        self.transfer_stats = TransferStats()
        logger.info("prefill rank %d/%d ready: bootstrap %s, backend %s, decode tp %s", tp_rank, tp_size,
                    self.bootstrap_addr, args.transfer_backend, args.disaggregation_decode_tp or "any")

    # ================================================================== admission
    def add_new_request(self, req: Req) -> None:
        req.sampling = msgspec.structs.replace(req.sampling, max_new_tokens=1,
                                               min_new_tokens=min(req.sampling.min_new_tokens, 1))
        room = int(req.bootstrap_room)
        n_pages = -(-len(req.origin_input_ids) // self.page_size)
        first = self.runner.hybrid.first_sent_page(len(req.origin_input_ids), self.page_size)
        sender = self.kv_manager.create_sender(room)
        t = PrefillTransfer(req, sender, room, n_pages - first, sent_pages=first, first_page=first)
        self.transfers[req.rid] = t
        self.rooms[room] = req.rid
        self.bootstrap_queue.append(req)
        logger.info("rid=%s room=%d bootstrap: %d pages to send", req.rid, room, n_pages)
        self._init_senders()

    def _init_senders(self) -> None:
        """Give bootstrap requests without one a metadata slot and init() their sender (FCFS)."""
        for req in self.bootstrap_queue:
            t = self.transfers[req.rid]
            if t.metadata_index is not None:
                continue
            slot = self.metadata_alloc.alloc()
            if slot is None:
                return
            t.metadata_index = slot
            t.sender.init(t.num_pages, slot)

    # ================================================================== queues
    def has_pending_work(self) -> bool:
        return bool(self.bootstrap_queue or self.inflight_queue)

    def recv_requests(self, timeout_ms: int) -> list:
        # only transfers to wait for: block briefly instead of spinning on the CPU the forwards need
        if timeout_ms == 0 and not (self.waiting_queue or self.running_batch.reqs or self.chunked_req):
            timeout_ms = 2
        return super().recv_requests(timeout_ms)

    def process_queues(self) -> None:
        """Poll every sender once (TP consensus) and move requests between stages."""
        self._init_senders()
        tracked = self.bootstrap_queue + self.waiting_queue + self.inflight_queue
        if self.chunked_req is not None:
            tracked.append(self.chunked_req)
        tracked = [r for r in tracked if r.rid in self.transfers]
        if not tracked:
            return
        polls = poll_and_all_reduce([self.transfers[r.rid].sender for r in tracked], self.consensus_group)
        for req, poll in zip(tracked, polls, strict=True):
            t = self.transfers.get(req.rid)
            if t is None:
                continue
            if poll == KVPoll.Failed:
                self._fail(req, t)
            elif t.stage == "bootstrap" and poll >= KVPoll.WaitingForInput and t.metadata_index is not None:
                self.bootstrap_queue.remove(req)
                t.stage = "waiting"
                self.waiting_queue.append(req)
                logger.info("rid=%s room=%d waiting: TransferInfo received after %.3fs", req.rid, t.room,
                            time.monotonic() - t.created)
            elif t.stage == "inflight" and poll == KVPoll.Success:
                self._complete(req, t)

    def _fail(self, req: Req, t: PrefillTransfer) -> None:
        reason = failure_reason(t.sender)
        self.transfer_stats.failures += 1
        logger.warning("rid=%s room=%d transfer failed at stage %s: %s", req.rid, t.room, t.stage, reason)
        if req.finished():  # inflight: it finished its prefill; report the failure instead
            req.finished_reason = None
        req.finish({"type": "abort", "message": f"KV transfer failed: {reason}"}, error_status=500)
        self.abort_request(req.rid, f"KV transfer failed: {reason}")

    def _complete(self, req: Req, t: PrefillTransfer) -> None:
        now = time.monotonic()
        latency = now - (t.first_send or t.created)
        self.transfer_stats.success(t.sender.bytes_sent, latency)
        self.inflight_queue.remove(req)
        self._drop_transfer(req, t)
        logger.info("rid=%s room=%d transfer done: %d pages, %d bytes in %.3fs", req.rid, t.room, t.num_pages,
                    t.sender.bytes_sent, latency)
        super().finish_req(req)
        self.collect_update(req)

    def _drop_transfer(self, req: Req, t: PrefillTransfer) -> None:
        self.transfers.pop(req.rid, None)
        if self.rooms.get(t.room) == req.rid:
            del self.rooms[t.room]
        if t.metadata_index is not None:
            self.metadata_alloc.free(t.metadata_index)
            t.metadata_index = None

    # ================================================================== sending
    def _page_ids(self, req: Req, start_page: int, end_page: int) -> list[int]:
        ps = self.page_size
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        return (row[start_page * ps: end_page * ps: ps] // ps).tolist()

    def on_prefill_chunk_done(self, req: Req) -> None:
        t = self.transfers.get(req.rid)
        if t is None:
            return
        full = req.kv_len // self.page_size
        if full > t.sent_pages:
            pages = self._page_ids(req, t.sent_pages, full)
            if t.first_send is None:
                t.first_send = time.monotonic()
            t.sender.send(pages)
            logger.info("rid=%s room=%d chunk sent: pages %d..%d", req.rid, t.room, t.sent_pages, full - 1)
            t.sent_pages = full

    def on_prefill_done(self, req: Req) -> None:
        t = self.transfers.get(req.rid)
        if t is None or not req.output_ids:
            return
        tok = req.output_ids[0]
        lp_val, tops = 0.0, None
        if req.return_logprob and req.output_logprobs:
            lp_val = float(req.output_logprobs[0][0])
            if req.top_logprobs_num > 0 and req.output_top_logprobs:
                tops = req.output_top_logprobs[0][:MAX_TOP_LOGPROBS]
        self.metadata.set_buf(t.metadata_index, tok, cached_tokens=req.cached_tokens, logprob_val=lp_val,
                              logprob_idx=tok,
                              top_vals=torch.tensor([v for v, _ in tops], dtype=torch.float32) if tops else None,
                              top_idxs=torch.tensor([i for _, i in tops], dtype=torch.int32) if tops else None,
                              room=t.room)
        end = t.first_page + t.num_pages
        pages = self._page_ids(req, t.sent_pages, end)
        if t.first_send is None:
            t.first_send = time.monotonic()
        # hybrid models: the request's state slot goes with the last chunk
        states = [int(self.req_to_token_pool.row_state[req.req_pool_idx])] if self.runner.hybrid.has_state \
            else None
        t.sender.send(pages, state_indices=states, last=True)
        logger.info("rid=%s room=%d last chunk sent: pages %d..%d with metadata (first token %d)%s", req.rid,
                    t.room, t.sent_pages, end - 1, tok, f", state slot {states[0]}" if states else "")
        t.sent_pages = end
        t.stage = "inflight"

    # ================================================================== finishing
    def finish_req(self, req: Req) -> None:
        t = self.transfers.get(req.rid)
        if t is not None and t.stage == "inflight" and req.to_abort is None:
            # the KV stays until the transfer is done; the response waits for it too
            self.inflight_queue.append(req)
            logger.info("rid=%s room=%d inflight", req.rid, t.room)
            return
        super().finish_req(req)

    def collect_update(self, req: Req) -> None:
        t = self.transfers.get(req.rid)
        if t is not None and not req.error_status and req.to_abort is None:
            return  # the answer goes out when the transfer is done
        super().collect_update(req)

    def abort_in_extra_queues(self, req: Req, message: str) -> bool:
        for q in (self.bootstrap_queue, self.inflight_queue):
            if req in q:
                q.remove(req)
                if q is self.inflight_queue and req.finished() and not req.error_status:
                    req.finished_reason = None  # it ends as aborted, not with its first token
                return True
        return False

    def release_req(self, req: Req) -> None:
        t = self.transfers.get(req.rid)
        if t is not None:
            if t.sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                t.sender.abort()
            self._drop_transfer(req, t)
        super().release_req(req)

    # ================================================================== stats
    def queue_counts(self) -> dict[str, int]:
        return {"bootstrap": len(self.bootstrap_queue),
                "waiting": len(self.waiting_queue) + (1 if self.chunked_req is not None else 0),
                "inflight": len(self.inflight_queue)}

    def get_stats(self) -> dict[str, Any]:
        s = super().get_stats()
        s.update({
            "disaggregation_mode": "prefill",
            "bootstrap_addr": self.bootstrap_addr,
            "metadata_slots_free": self.metadata_alloc.available(),
            "metadata_slots_total": self.num_metadata_slots,
            **self.transfer_stats.as_stats(),
        })
        return s

    def close(self) -> None:
        self.kv_manager.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()
