"""Retraction that keeps KV (`--decode-offload-size`): a retraction victim's pages (and state slot) go to
the host store (`common/memory/host_store.py`) before they are freed, and come back into fresh pages
when the request is scheduled again, so it resumes decoding with no prefill. `sched` is the Scheduler."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.memory.host_store import HostKVStore

if TYPE_CHECKING:
    from common.scheduler.req import Req

logger = logging.getLogger("scheduler")


def make_host_store(args, sched) -> HostKVStore | None:
    """The scheduler's host store for retracted requests' KV (`--decode-offload-size`), or None (off)."""
    tokens = getattr(args, "decode_offload_tokens", 0)
    if tokens < sched.page_size:  # 0: off (and less than one page would hold nothing)
        return None
    pool = sched.req_to_token_pool
    store = HostKVStore(tokens, sched.kv_pool, pool.state_pool, state_slots=pool.size)
    logger.info("decode offload: retracted requests keep their KV in a host store of %d tokens (%.1f MiB)",
                store.capacity_tokens, store.nbytes() / 2**20)
    return store


def restore(sched, req: Req) -> None:
    """A retracted request's KV (and state) comes back from the host store into a new row and fresh
    pages; it rejoins the running batch and its next decode step feeds its last output token, as
    if it had never left (the prefill adder has budgeted the pages)."""
    store = sched.host_store
    n = store.kv_len(req.rid)
    if n != req.seqlen - 1:
        raise RuntimeError(f"rid={req.rid}: {n} tokens of KV stored for a sequence of {req.seqlen}")
    num_pages = sched.allocator.pages_for(n)
    sched.running_batch.ensure_free_pages(num_pages)
    row = sched.req_to_token_pool.alloc()
    if row is None:
        raise RuntimeError("no free req pool row (the scheduler checks this before)")
    pages = sched.allocator.alloc_pages(num_pages)
    pool = sched.req_to_token_pool
    store.load(req.rid, pages, pool.state_of(row) if pool.state_pool is not None else None)
    req.release_kv_state()  # drops a prefix match the schedule policy may have made (never locked)
    pool.write(row, 0, sched.allocator.slots_of_pages(pages, n))
    req.req_pool_idx, req.kv_len = row, n
    req.extend_input_len = 0
    sched.num_retract_restored += 1
    sched.running_batch.merge([req])
    logger.info("rid=%s restored from the host store: %d tokens of KV, no prefill", req.rid, n)

def offload_victim(sched, req: Req) -> None:
    """A retraction victim, still holding its KV: copy its pages (and state slot) to the host store."""
    row, n = req.req_pool_idx, req.kv_len
    pool = sched.req_to_token_pool
    pages = sched.allocator.pages_of_slots(pool.slots(row, 0, n)).tolist()
    state = pool.state_of(row) if pool.state_pool is not None else None
    if sched.host_store.store(req.rid, pages, n, state):
        sched.num_retract_offloaded += 1
