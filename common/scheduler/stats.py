"""The scheduler's figures for `/server_info` and `/metrics` (`Scheduler.get_stats`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from common.memory.host_store import HostKVStore

logger = logging.getLogger("scheduler")


def scheduler_stats(sched) -> dict[str, Any]:
    """What /server_info shows of a scheduler: queues, KV use, caches, retractions and the role's figures."""
    free = sched.allocator.available_size()
    total = sched.allocator.capacity
    evictable = sched.tree_cache.evictable_size()
    now = time.monotonic()
    while sched._gen_window and now - sched._gen_window[0][0] > 10.0:
        sched._gen_window.popleft()
    if len(sched._gen_window) >= 2:
        span = max(now - sched._gen_window[0][0], 1e-3)
        gen = sum(n for _, n in sched._gen_window) / span
    else:
        gen = 0.0
    return {
        "dp_rank": sched.dp_rank,
        "num_running_reqs": sched.num_running_slots_used(),
        "num_waiting_reqs": len(sched.waiting_queue),
        "num_queue_reqs": sched.queue_counts(),
        "num_queued_reqs": sched.num_queued_reqs(),
        "max_queued_requests": sched.admission.limit,
        "num_queue_full_refused": sched.admission.refused,
        "kv_free_tokens": free,
        "kv_total_tokens": total,
        "kv_evictable_tokens": evictable,
        "req_slots_free": sched.req_to_token_pool.available_size(),
        "req_slots_total": sched.req_to_token_pool.size,
        "cache_hit_rate": sched.total_cached_tokens / sched.total_prompt_tokens if sched.total_prompt_tokens else 0.0,
        "num_tokens_used": total - free - evictable,
        "torch_threads": sched.borrower.own if sched.borrower is not None else torch.get_num_threads(),
        "gen_throughput": gen,
        "new_token_ratio": sched.new_token_ratio.value,
        "num_retractions": sched.num_retractions,
        "num_retract_offloaded": sched.num_retract_offloaded,
        "num_retract_restored": sched.num_retract_restored,
        "num_retract_recomputed": sched.num_retract_recomputed,
        "total_prefill_tokens": sched.total_prefill_tokens,
        "total_prompt_tokens": sched.total_prompt_tokens,
        "queue_time_hist": sched.queue_time.as_stats(),
        **(sched.host_store.stats() if sched.host_store is not None else HostKVStore.off_stats()),
        "forward_ct": sched.forward_ct,
        "overlap_schedule": sched.overlap is not None,
        "num_overlapped_steps": sched.overlap.overlapped if sched.overlap is not None else 0,
        "mixed_chunk": sched.args.enable_mixed_chunk,
        "num_mixed_steps": sched.num_mixed_steps,
        "total_generated_tokens": sched.total_generated_tokens,
        "speculative_algorithm": sched.args.speculative_algorithm,
        **(sched.drafter.stats.as_dict() if sched.drafter is not None else {}),
        "radix_cache": sched.tree_cache.enabled,
        "radix_cache_tokens": sched.tree_cache.total_size(),
        **(sched.kv_events.stats() if sched.kv_events is not None else {}),
        "page_size": sched.page_size,
        "context_length": sched.context_length,
        "max_running_requests": sched.max_running_requests,
        **({"pp_size": sched.runner.pp_size, "pp_micro_batches": sched.runner.model.micro_batches}
           if getattr(sched.runner, "pp_size", 1) > 1 else {}),
        **(sched.runner.hybrid.stats() if hasattr(sched.runner, "hybrid") else {}),
        **sched.priority.stats(),
        **sched.grammar_queue.stats(),
        **_role_stats(sched),
        **_loan_stats(sched),
    }


def _loan_stats(sched) -> dict[str, Any]:
    loan = sched.lender or sched.borrower  # common/core_loan.py
    return loan.stats() if loan is not None else {}


def _role_stats(sched) -> dict[str, Any]:
    try:
        return sched.hooks.stats()
    except Exception:
        logger.exception("stats hook failed; stats without the role's figures")
        return {}
