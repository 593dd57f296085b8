"""The front end's view of its DP groups (--dp-size N): which group a request goes to, and one node's
figures out of the groups' stats.

* `DPGroups.choose(rank, allowed)`: the group of a request: `rank` when the request names one (its
  `data_parallel_rank`, or `bootstrap_room mod N` for a PD request; `common/server/http.py` checks
  both), else the group (of `allowed`, default all) with the fewest live requests (ties go round the
  groups, so an idle node spreads single requests too). `started` / `ended` keep those counts. The
  router's `--dp-aware` keeps one per decode worker, counting its own requests in flight.
* `merge_stats(groups)`: counts, token figures, rates and histograms add up; ratios and averages
  (`*_rate`, `*_ratio`, `*_avg_s`, ...) are the groups' mean; settings every group shares (page size,
  context length) and strings are group 0's. The groups' own stats stay under `"dp"`, in rank order.
"""

from __future__ import annotations

from typing import Any

# figures that are the same for every group, not a quantity of it
SHARED_KEYS = frozenset({"page_size", "context_length", "speculative_algorithm", "disaggregation_mode",
                         "moe_ep_size", "moe_expert_replicas"})
MEAN_SUFFIXES = ("_rate", "_ratio", "_avg_s", "_last_s", "accept_length")


class DPGroups:
    def __init__(self, size: int) -> None:
        self.size = size
        self.live = [0] * size  # requests of this front end in each group, from submit to release
        self._cursor = 0

    def choose(self, rank: int | None, allowed: list[int] | None = None) -> int:
        """`rank` if given, else the group of `allowed` (default: all) with the fewest live requests."""
        if rank is not None:
            return rank
        if self.size == 1:
            return 0
        ok = set(range(self.size) if allowed is None else allowed)
        order = [k for k in ((self._cursor + i) % self.size for i in range(self.size)) if k in ok]
        best = min(order, key=self.live.__getitem__)
        self._cursor = (best + 1) % self.size
        return best

    def started(self, rank: int) -> None:
        self.live[rank] += 1

    def ended(self, rank: int) -> None:
        self.live[rank] -= 1


def merge_stats(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's stats from its groups' (a single group's come back as they are)."""
    if len(groups) == 1:
        return groups[0]
    out = _merge_dicts(groups)
    out.pop("dp_rank", None)
    out["dp_size"] = len(groups)
    out["dp"] = groups
    return out


def _merge_dicts(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in dicts[0]:
        values = [d.get(key) for d in dicts]
        out[key] = _merge(key, values)
    return out


def _merge(key: str, values: list[Any]) -> Any:
    first = values[0]
    if key in SHARED_KEYS or first is None or isinstance(first, (bool, str)):
        return first
    if isinstance(first, dict):
        if all(isinstance(v, dict) for v in values):
            return _merge_dicts(values)
        return first
    if isinstance(first, list):
        if key == "buckets" or not all(isinstance(v, list) and len(v) == len(first) for v in values):
            return first
        return [_merge(key, list(column)) for column in zip(*values, strict=True)]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return first
    if isinstance(first, float) and key.endswith(MEAN_SUFFIXES):
        return sum(values) / len(values)
    return sum(values)
