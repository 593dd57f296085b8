"""The prefill role of one TP rank: `PrefillRole`, the scheduler's hooks, and `PrefillScheduler`,
which builds a scheduler with them (the class the node's scheduler processes are started with).

A request goes bootstrap → waiting → inflight (`prefill_node/queues.py`):
* on arrival (`on_new_request`) its `max_new_tokens` becomes 1 (the first token is all a prefill node
  samples) and its `KVSender` is created; it waits in the bootstrap queue for a metadata slot and the
  decode side's `TransferInfo`, then `add_request` hands it to the scheduler;
* after every chunk but the last (`on_chunk_done`) the full pages computed so far are sent (with the
  device's completion of the work launched so far, on a GPU: the sender writes once it is done); when
  the prefill is done (`on_prefill_done`) the request's `MetadataBuffers` row (first token, its
  logprob and top logprobs, cached tokens, room) is written and the remaining pages, the partial one
  included, are sent with `last=True` (with the hybrid state slot);
* it then finishes, but `on_finished` holds its KV (and radix-cache lock) and its answer in the
  inflight queue until the transfer polls Success: `release_held` caches the KV and sends the
  answer (the SGLang-native prefill body: first token, prompt logprobs when asked).

Every sender in any stage is polled once per iteration (`before_schedule`) with
`poll_and_all_reduce` over the consensus group, so all TP ranks move requests in lockstep; a failure
(decode aborted or died, timeout, a bad peer value, injected failure) ends the request wherever it
is with HTTP 500 (`finish_requests`), and `on_release` frees its sender and metadata slot. A step of
one request that raises (`guarded`) fails that request only.

The bootstrap server runs in rank 0's scheduler process: `common/` (the front end) must not depend
on `transfer/`, and the server then lives exactly as long as the ranks it describes — when the
scheduler dies the decode side stops finding it, which is the signal it needs. Rank 0 binds the
server before it builds its own manager; the other ranks' managers retry their registration until
the server answers.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import torch

from common.scheduler.req import Req
from common.scheduler.scheduler import Scheduler
from disaggregation.kv import advertised_host, build_kv_manager, build_metadata
from disaggregation.requests import MAX_TOP_LOGPROBS
from disaggregation.role import PDRole
from prefill_node.queues import BootstrapQueue, InflightQueue, PrefillRequest, PrefillStage
from transfer.bootstrap import BootstrapServer
from transfer.metadata import MetadataAllocator
from transfer.sender import PrefillKVManager

logger = logging.getLogger("prefill")


def start_bootstrap_server(args) -> BootstrapServer:
    server = BootstrapServer(args.host, args.disaggregation_bootstrap_port,
                             secret=getattr(args, "cluster_secret", None))
    server.start()
    logger.info("bootstrap server on %s:%d", args.host, server.port)
    return server


def draft_fields(req: Req) -> dict:
    """EAGLE / MTP: the request's first draft (topk_p 1 says there is one) and the draft layers' hidden
    state, from which the decode node drafts the rest of its first chain (common/draft_layers.py)."""
    if req.draft_token is None:
        return {}
    return {"topk_index": [req.draft_token], "topk_p": [1.0], "hidden_state": req.draft_hidden}


class PrefillRole(PDRole):
    role = "prefill"
    logger = logger

    def __init__(self, sched: Scheduler, args, tp_rank: int, tp_size: int) -> None:
        # one metadata row per request between bootstrap and the end of its transfer
        self.num_metadata_slots = 2 * sched.req_to_token_pool.size + sched.max_running_requests
        super().__init__(sched, MetadataAllocator(self.num_metadata_slots))
        self.metadata = build_metadata(self.num_metadata_slots, sched, args.draft_layers)
        # one bootstrap server per node, in DP group 0's first rank: every rank of every group and stage
        # registers with it
        first = tp_rank == 0 and sched.dp_rank == 0 and sched.pp_rank == 0
        self.bootstrap_server = start_bootstrap_server(args) if first else None
        self.bootstrap_addr = f"{advertised_host(args.host)}:{args.disaggregation_bootstrap_port}"
        try:
            self.kv_manager = build_kv_manager(PrefillKVManager, args, sched.runner, self.metadata, tp_rank,
                                               tp_size, dp_rank=sched.dp_rank,
                                               decode_tp=args.disaggregation_decode_tp or 0,
                                               bootstrap_addr=self.bootstrap_addr)
        except Exception:
            if self.bootstrap_server is not None:
                self.bootstrap_server.stop()
            raise
        self.bootstrap = BootstrapQueue(self.metadata_alloc)
        self.inflight = InflightQueue()
        logger.info("prefill rank %d/%d of dp group %d ready: bootstrap %s, backend %s, "
                    "decode tp %s", tp_rank,
                    tp_size, sched.dp_rank, self.bootstrap_addr, args.transfer_backend,
                    args.disaggregation_decode_tp or "any")

    def queue_of(self, t: PrefillRequest):
        return {PrefillStage.BOOTSTRAP: self.bootstrap, PrefillStage.INFLIGHT: self.inflight}.get(t.stage)

    # ================================================================== admission
    def on_new_request(self, req: Req) -> bool:
        req.sampling = msgspec.structs.replace(req.sampling, max_new_tokens=1,
                                               min_new_tokens=min(req.sampling.min_new_tokens, 1))
        room = int(req.bootstrap_room)
        alloc = self.sched.allocator
        n_pages = alloc.pages_for(len(req.origin_input_ids))
        first = self.sched.runner.hybrid.first_sent_page(len(req.origin_input_ids), alloc.page_size)
        t = PrefillRequest(req=req, room=room, conn=self.kv_manager.create_sender(room),
                           num_pages=n_pages - first, first_page=first, sent_pages=first)
        self.requests[req.rid] = t
        self.bootstrap.add(t)
        logger.info("rid=%s room=%d bootstrap: %d pages to send", req.rid, room, n_pages)
        self.bootstrap.init_senders(self.rank)
        return True

    @property
    def rank(self):
        """Metadata slots go to the highest priority first, oldest first among equals (so in arrival order
        when no request names a priority)."""
        return self.sched.priority.rank

    # ================================================================== every iteration
    def before_schedule(self) -> None:
        """Poll every sender once (TP consensus) and move requests between stages."""
        self.bootstrap.init_senders(self.rank)
        tracked = list(self.requests.values())
        if not tracked:
            return
        polls = self.poll(tracked)
        for t in self.bootstrap.take_ready(polls):
            logger.info("rid=%s room=%d waiting: TransferInfo received after %.3fs", t.rid, t.room,
                        time.monotonic() - t.created)
            self.guarded(t, "handing the request to the scheduler", self.sched.add_request, t.req)
        for t in self.inflight.take_done(polls):
            self.guarded(t, "completing the transfer", self._complete, t)

    def _complete(self, t: PrefillRequest) -> None:
        latency = time.monotonic() - (t.first_send or t.created)
        self.transfer_stats.success(t.conn.bytes_sent, latency)
        self.forget(t)
        logger.info("rid=%s room=%d transfer done: %d pages, %d bytes in %.3fs", t.rid, t.room, t.num_pages,
                    t.conn.bytes_sent, latency)
        self.sched.release_held(t.rid)

    # ================================================================== sending
    def _pages(self, req: Req, start_page: int, end_page: int) -> list[int]:
        ps = self.sched.allocator.page_size
        slots = self.sched.req_to_token_pool.slots(req.req_pool_idx, start_page * ps, end_page * ps)
        return self.sched.allocator.pages_of_slots(slots).tolist()

    def _send(self, t: PrefillRequest, end_page: int, **kw) -> int:
        """Send pages sent_pages .. end_page - 1; returns the first of them."""
        if t.first_send is None:
            t.first_send = time.monotonic()
        # on a GPU the forward that wrote these pages may still be running: the chunk job waits on this
        t.conn.send(self._pages(t.req, t.sent_pages, end_page), ready=self.sched.runner.work_done(), **kw)
        start, t.sent_pages = t.sent_pages, end_page
        return start

    def on_chunk_done(self, req: Req) -> None:
        t = self.requests.get(req.rid)
        if t is None:
            return
        full = self.sched.allocator.full_pages(req.kv_len)
        if full > t.sent_pages:
            start = self._send(t, full)
            logger.info("rid=%s room=%d chunk sent: pages %d..%d", req.rid, t.room, start, full - 1)

    def on_prefill_done(self, req: Req) -> None:
        t = self.requests.get(req.rid)
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
                              top_vals=torch.tensor([v for v, _ in tops], dtype=torch.float32)
                              if tops else None,
                              top_idxs=torch.tensor([i for _, i in tops], dtype=torch.int32)
                              if tops else None, room=t.room, **draft_fields(req))
        # hybrid models: the request's state slot goes with the last chunk
        pool = self.sched.req_to_token_pool
        states = [pool.state_of(req.req_pool_idx)] if self.sched.runner.hybrid.has_state else None
        end = t.first_page + t.num_pages
        start = self._send(t, end, state_indices=states, last=True)
        logger.info("rid=%s room=%d last chunk sent: pages %d..%d with metadata (first token %d)%s", req.rid,
                    t.room, start, end - 1, tok, f", state slot {states[0]}" if states else "")
        self.inflight.add(t)

    # ================================================================== ending
    def on_finished(self, req: Req) -> bool:
        t = self.requests.get(req.rid)
        if t is None or t.stage is not PrefillStage.INFLIGHT:
            return False
        logger.info("rid=%s room=%d inflight", req.rid, t.room)
        return True  # the KV stays until the transfer is done; the answer waits for it too

    def on_release(self, req: Req) -> None:
        t = self.requests.get(req.rid)
        if t is not None:
            self.release_conn(t)
            self.forget(t)

    # ================================================================== loop and stats
    def has_work(self) -> bool:
        return bool(self.bootstrap or self.inflight)

    def unstarted(self) -> list[str]:
        """The requests still waiting for the decode's TransferInfo: nothing computed, nothing sent."""
        return [t.rid for t in self.bootstrap]

    def queue_counts(self) -> dict[str, int]:
        s = self.sched
        return {"bootstrap": len(self.bootstrap),
                "waiting": len(s.waiting_queue) + (1 if s.chunked_req is not None else 0),
                "inflight": len(self.inflight)}

    def stats(self) -> dict[str, Any]:
        pool = self.sched.req_to_token_pool
        return {"disaggregation_mode": "prefill", "bootstrap_addr": self.bootstrap_addr,
                "req_rows_free": pool.available_size(), "req_rows_total": pool.size,
                "metadata_slots_free": self.metadata_alloc.available(),
                "metadata_slots_total": self.num_metadata_slots, **self.pd_stats()}

    def close(self) -> None:
        self.kv_manager.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()


class PrefillScheduler(Scheduler):
    """The scheduler of a prefill rank: the common one with `PrefillRole` as its hooks."""

    def __init__(self, args, model_dir: str, tp_rank: int = 0, tp_size: int = 1, tp_group=None, **kw) -> None:
        super().__init__(args, model_dir, tp_rank, tp_size, tp_group, **kw)
        self.hooks = PrefillRole(self, args, tp_rank, tp_size)
