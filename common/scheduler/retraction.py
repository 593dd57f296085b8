"""Retraction: taking running requests out of the running batch, and bringing them back.

A request is retracted when a decode step finds no KV memory for the running batch's next tokens
(`retract_for_decode`: fewest output tokens first, or lowest priority first under priority
scheduling) or when priority preemption picks it (`preempt`, called by `priority.py`). Either way it
goes back to the waiting queue with its output so far and finishes with the same tokens:

* with a host store (`--decode-offload-size`, `common/memory/host_store.py`) its pages (and a hybrid
  model's state slot) are copied there before they are freed, and `restore` copies them back into
  fresh pages when the prefill builder schedules it again: it resumes decoding with no prefill;
* without an entry there (no store, or it was full) it prefills prompt + output again.

This object owns the host store and the retraction counters the stats report.
"""

from __future__ import annotations

import logging

from common.memory.host_store import HostKVStore
from common.scheduler.batch import ScheduleBatch
from common.scheduler.req import Req

logger = logging.getLogger("scheduler")


def make_host_store(args, page_size: int, kv_pool, req_to_token_pool) -> HostKVStore | None:
    """The host store for retracted requests' KV (`--decode-offload-size`), or None (off)."""
    tokens = getattr(args, "decode_offload_tokens", 0)
    if tokens < page_size:  # 0: off (and less than one page would hold nothing)
        return None
    store = HostKVStore(tokens, kv_pool, req_to_token_pool.state_pool, state_slots=req_to_token_pool.size)
    logger.info("decode offload: retracted requests keep their KV in a host store of %d tokens (%.1f MiB)",
                store.capacity_tokens, store.nbytes() / 2**20)
    return store


class Retraction:
    def __init__(self, host_store: HostKVStore | None, running_batch: ScheduleBatch) -> None:
        self.host_store = host_store
        self.running_batch = running_batch
        self.allocator = running_batch.allocator
        self.req_to_token_pool = running_batch.req_to_token_pool
        self.tree_cache = running_batch.tree_cache
        self.num_retractions = 0
        self.num_offloaded = 0  # victims whose KV went to the host store
        self.num_restored = 0  # resumed with their KV copied back (no prefill)
        self.num_recomputed = 0  # resumed by prefilling prompt + output again (no entry: the fallback)

    def holds(self, rid: str) -> bool:
        """Whether the host store keeps this request's KV."""
        return self.host_store is not None and rid in self.host_store

    def kv_len(self, rid: str) -> int:
        return self.host_store.kv_len(rid)

    def discard(self, rid: str) -> None:
        """The request ended: its entry, if any, is dropped."""
        if self.host_store is not None:
            self.host_store.discard(rid)

    # ------------------------------------------------------------------ taking requests out
    def retract_for_decode(self, order_key=None) -> tuple[list[Req], float]:
        """The running batch's next tokens have no free KV: retract until the rest can decode.
        Returns (the victims, stage WAITING, for the front of the waiting queue; the new
        new_token_ratio estimate)."""
        offload = self._offload if self.host_store is not None else None
        victims, ratio = self.running_batch.retract_decode(before_release=offload, order_key=order_key)
        self.num_retractions += len(victims)
        for v in victims:
            v.mark("waiting")  # retracted
            logger.info("rid=%s retracted after %d output tokens (KV memory full); %s", v.rid,
                        len(v.output_ids),
                        "KV in the host store" if self.holds(v.rid) else "will prefill again")
        return victims, ratio

    def preempt(self, victim: Req) -> None:
        """Retract one running request for a higher-priority one (the caller puts it in the waiting
        queue)."""
        self.running_batch.filter(lambda r: r is not victim)
        if self.host_store is not None:
            self._offload(victim)
        self.tree_cache.cache_finished_req(victim)
        victim.reset_for_retract()
        self.num_retractions += 1

    def _offload(self, req: Req) -> None:
        """A victim, still holding its KV: copy its pages (and state slot) to the host store."""
        row, n = req.req_pool_idx, req.kv_len
        pool = self.req_to_token_pool
        pages = self.allocator.pages_of_slots(pool.slots(row, 0, n)).tolist()
        state = pool.state_of(row) if pool.state_pool is not None else None
        if self.host_store.store(req.rid, pages, n, state):
            self.num_offloaded += 1

    # ------------------------------------------------------------------ bringing them back
    def restore(self, req: Req) -> None:
        """A retracted request's KV (and state) comes back from the host store into a new row and fresh
        pages; it rejoins the running batch and its next decode step feeds its last output token, as
        if it had never left (the prefill adder has budgeted the pages)."""
        store, pool, alloc = self.host_store, self.req_to_token_pool, self.allocator
        n = store.kv_len(req.rid)
        if n != req.seqlen - 1:
            raise RuntimeError(f"rid={req.rid}: {n} tokens of KV stored for a sequence of {req.seqlen}")
        num_pages = alloc.pages_for(n)
        self.running_batch.ensure_free_pages(num_pages)
        row = pool.alloc()
        if row is None:
            raise RuntimeError("no free req pool row (the scheduler checks this before)")
        pages = alloc.alloc_pages(num_pages)
        store.load(req.rid, pages, pool.state_of(row) if pool.state_pool is not None else None)
        req.release_kv_state()  # drops a prefix match the schedule policy may have made (never locked)
        pool.write(row, 0, alloc.slots_of_pages(pages, n))
        req.req_pool_idx, req.kv_len = row, n
        req.extend_input_len = 0
        self.num_restored += 1
        self.running_batch.merge([req])
        logger.info("rid=%s restored from the host store: %d tokens of KV, no prefill", req.rid, n)

    def stats(self) -> dict[str, int]:
        return {"num_retractions": self.num_retractions, "num_retract_offloaded": self.num_offloaded,
                "num_retract_restored": self.num_restored, "num_retract_recomputed": self.num_recomputed}

    def store_stats(self) -> dict:
        return self.host_store.stats() if self.host_store is not None else HostKVStore.off_stats()
