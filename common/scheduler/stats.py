"""The scheduler's figures for `/server_info` and `/metrics`.

`Counters` holds the step counters the scheduler's components add to (forwards, prefill and generated
tokens, the queue-time histogram). `SchedulerStats` is given, once, every component whose figures it
reports (queues, memory, retraction, priority, overlap, speculation, ...) and assembles them on
`collect`; the role's hooks (its figures and queue counts) and the core loan are handed to `collect`
because a role installs its hooks after the scheduler is built.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch

from common.histogram import BucketCounts
from common.layers.moe import expert_load_stats

logger = logging.getLogger("scheduler")

GEN_WINDOW_S = 10.0  # gen_throughput: tokens generated over this many seconds


class Counters:
    def __init__(self) -> None:
        self.forward_ct = 0
        self.num_mixed_steps = 0  # prefill forwards the running requests decoded in (--enable-mixed-chunk)
        self.total_prefill_tokens = 0  # tokens computed by prefill (extend) forwards
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.total_generated_tokens = 0
        self.queue_time = BucketCounts()  # arrival to first prefill (the role's queues included)
        self._gen_window: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)

    def generated_in_step(self, n: int) -> None:
        self._gen_window.append((time.monotonic(), n))

    def gen_throughput(self) -> float:
        """Tokens per second over the last GEN_WINDOW_S seconds of steps."""
        now = time.monotonic()
        window = self._gen_window
        while window and now - window[0][0] > GEN_WINDOW_S:
            window.popleft()
        if len(window) < 2:
            return 0.0
        return sum(n for _, n in window) / max(now - window[0][0], 1e-3)


class SchedulerStats:
    def __init__(self, args, dp_rank: int, runner, queues, counters: Counters, *, tree_cache, admission,
                 retraction, new_token_ratio, priority, overlap, drafter, kv_events) -> None:
        self.args = args
        self.dp_rank = dp_rank
        self.runner = runner
        self.queues = queues
        self.counters = counters
        self.tree_cache = tree_cache
        self.allocator = runner.allocator
        self.req_to_token_pool = runner.req_to_token_pool
        self.admission = admission
        self.retraction = retraction
        self.new_token_ratio = new_token_ratio
        self.priority = priority
        self.overlap = overlap
        self.drafter = drafter
        self.kv_events = kv_events

    def collect(self, hooks, lender, borrower) -> dict[str, Any]:
        """What /server_info shows of a scheduler: queues, KV use, caches, retractions, the role's figures
        (`hooks`, `SchedulerHooks`) and the core loan's (`lender`, `borrower`: common/core_loan.py, None
        when the node has none)."""
        c, queues, runner = self.counters, self.queues, self.runner
        free, total = self.allocator.available_size(), self.allocator.capacity
        evictable = self.tree_cache.evictable_size()
        pool = self.req_to_token_pool
        return {
            "dp_rank": self.dp_rank,
            "num_running_reqs": queues.num_running_slots_used(),
            "num_waiting_reqs": len(queues.waiting_queue),
            # the role's stages when it has its own
            "num_queue_reqs": hooks.queue_counts() or queues.counts(),
            "num_queued_reqs": queues.num_queued(),
            "max_queued_requests": self.admission.limit,
            "num_queue_full_refused": self.admission.refused,
            "kv_free_tokens": free,
            "kv_total_tokens": total,
            "kv_evictable_tokens": evictable,
            "req_slots_free": pool.available_size(),
            "req_slots_total": pool.size,
            "cache_hit_rate": c.total_cached_tokens / c.total_prompt_tokens if c.total_prompt_tokens else 0.0,
            "num_tokens_used": total - free - evictable,
            "torch_threads": borrower.own if borrower is not None else torch.get_num_threads(),
            "gen_throughput": c.gen_throughput(),
            "new_token_ratio": self.new_token_ratio.value,
            **self.retraction.stats(),
            "total_prefill_tokens": c.total_prefill_tokens,
            "total_prompt_tokens": c.total_prompt_tokens,
            "queue_time_hist": c.queue_time.as_stats(),
            **self.retraction.store_stats(),
            "forward_ct": c.forward_ct,
            "overlap_schedule": self.overlap is not None,
            "num_overlapped_steps": self.overlap.overlapped if self.overlap is not None else 0,
            "mixed_chunk": self.args.enable_mixed_chunk,
            "num_mixed_steps": c.num_mixed_steps,
            "total_generated_tokens": c.total_generated_tokens,
            "speculative_algorithm": self.args.speculative_algorithm,
            **(self.drafter.stats.as_dict() if self.drafter is not None else {}),
            "radix_cache": self.tree_cache.enabled,
            "radix_cache_tokens": self.tree_cache.total_size(),
            **(self.kv_events.stats() if self.kv_events is not None else {}),
            "page_size": runner.page_size,
            "context_length": runner.context_length,
            "max_running_requests": self.args.max_running_requests,
            **({"pp_size": runner.pp_size, "pp_micro_batches": runner.model.micro_batches}
               if getattr(runner, "pp_size", 1) > 1 else {}),
            **(runner.hybrid.stats() if hasattr(runner, "hybrid") else {}),
            **expert_load_stats(runner.model),
            **self.priority.stats(),
            **queues.grammar_queue.stats(),
            **_role_stats(hooks),
            **((lender or borrower).stats() if (lender or borrower) is not None else {}),
        }


def log_progress(s: dict[str, Any]) -> None:
    """A line of the stats in the log (every so many decode forwards)."""
    logger.info("decode: %d running, %d waiting, kv used %d/%d, evictable %d, gen %.1f tok/s, "
                "new_token_ratio %.3f",
                s["num_running_reqs"], s["num_waiting_reqs"], s["num_tokens_used"], s["kv_total_tokens"],
                s["kv_evictable_tokens"], s["gen_throughput"], s["new_token_ratio"])


def _role_stats(hooks) -> dict[str, Any]:
    try:
        return hooks.stats()
    except Exception:
        logger.exception("stats hook failed; stats without the role's figures")
        return {}
