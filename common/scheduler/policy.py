"""Order of the waiting queue, and the new_token_ratio schedule."""

from __future__ import annotations

from common.scheduler.req import Req

# LPM matches every waiting request against the tree each round; past this queue length the cost
# outweighs the gain and the order falls back to FCFS (as SGLang does)
LPM_MAX_QUEUE = 128


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache, priority) -> None:
        if policy not in ("fcfs", "lpm", "priority"):
            raise ValueError(f"unknown schedule policy {policy!r} (fcfs, lpm or priority)")
        self.policy = policy
        self.tree_cache = tree_cache
        self.priority = priority  # common/scheduler/priority.py

    def effective_policy(self, queue: list[Req]) -> str:
        if self.policy == "lpm" and (not self.tree_cache.enabled or len(queue) > LPM_MAX_QUEUE):
            return "fcfs"
        return self.policy

    def calc_priority(self, queue: list[Req]) -> None:
        """Reorder `queue` in place, the highest `priority` first under every policy (a request names none:
        0). Within a priority FCFS and priority keep arrival order (retracted requests were put back at
        the front), so with no priority named FCFS is exactly arrival order; LPM puts the longest cached
        prefix first (ties keep arrival order). The sorts are stable."""
        if self.effective_policy(queue) != "lpm":
            self.priority.sort(queue)
            return
        for r in queue:
            r.init_next_round_input(self.tree_cache)
        queue.sort(key=lambda r: (self.priority.rank(r), -len(r.prefix_indices)))


class NewTokenRatio:
    """Share of each running request's remaining max_new_tokens reserved when admitting prefills:
    starts at `init`, decays linearly by (init - min) / decay_steps per decode step down to `min`,
    and jumps up to the estimate given after a retraction."""

    def __init__(self, init: float, minimum: float, decay_steps: int) -> None:
        self.init = init
        self.min = minimum
        self.step_size = (init - minimum) / max(decay_steps, 1)
        self.value = init

    def decay(self) -> None:
        self.value = max(self.value - self.step_size, self.min)

    def on_retract(self, estimate: float) -> None:
        self.value = max(self.value, min(1.0, estimate))

    def reset(self) -> None:
        self.value = self.init
