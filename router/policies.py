"""Worker selection: random, round_robin, power_of_two and cache_aware (sglang-router's rules)."""

from __future__ import annotations

import itertools
import random

from router.config import RouterConfig
from router.registry import Worker
from router.tree import PrefixTree


class Policy:
    name = ""
    needs_text = False

    def select(self, workers: list[Worker], text: str | None) -> Worker:
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """A worker was removed."""

    def evict(self) -> None:
        """Periodic housekeeping."""


class RandomPolicy(Policy):
    name = "random"

    def select(self, workers, text):
        return workers[random.randrange(len(workers))]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def select(self, workers, text):
        return workers[next(self._counter) % len(workers)]


def _load(w: Worker) -> int:
    return w.load if w.load is not None else w.active


class PowerOfTwoPolicy(Policy):
    """Two distinct random candidates; the one with the lower load wins (load from the worker's
    /get_load, refreshed in the background; requests in flight through this router when unknown)."""

    name = "power_of_two"

    def select(self, workers, text):
        if len(workers) == 1:
            return workers[0]
        a, b = random.sample(workers, 2)
        la, lb = _load(a), _load(b)
        if la == lb:
            return a if a.active <= b.active else b
        return a if la < lb else b


class CacheAwarePolicy(Policy):
    """sglang-router's cache_aware: when the loads (requests in flight) are imbalanced — max - min >
    balance_abs_threshold and max > min * balance_rel_threshold — take the least loaded worker; otherwise
    the worker whose approximate prefix tree matches the most of the text if the match rate exceeds
    cache_threshold, else the worker with the smallest tree. The text is then inserted into the chosen
    worker's tree; trees are trimmed to max_tree_size characters every eviction interval."""

    name = "cache_aware"
    needs_text = True

    def __init__(self, cfg: RouterConfig):
        self.threshold = cfg.cache_threshold
        self.abs = cfg.balance_abs_threshold
        self.rel = cfg.balance_rel_threshold
        self.max_size = cfg.max_tree_size
        self.trees: dict[str, PrefixTree] = {}

    def _tree(self, w: Worker) -> PrefixTree:
        t = self.trees.get(w.url)
        if t is None:
            t = self.trees[w.url] = PrefixTree()
        return t

    def select(self, workers, text):
        text = text or ""
        if len(workers) == 1:
            chosen = workers[0]
        else:
            loads = [w.active for w in workers]
            hi, lo = max(loads), min(loads)
            if hi - lo > self.abs and hi > lo * self.rel:
                chosen = workers[loads.index(lo)]
            else:
                best, best_len = None, 0
                if text:
                    for w in workers:
                        n = self._tree(w).match(text)
                        if n > best_len:
                            best, best_len = w, n
                if best is not None and best_len / len(text) > self.threshold:
                    chosen = best
                else:
                    chosen = min(workers, key=lambda w: (self._tree(w).size, w.active))
        if text:
            self._tree(chosen).insert(text)
        return chosen

    def forget(self, url):
        self.trees.pop(url, None)

    def evict(self):
        for t in self.trees.values():
            t.evict(self.max_size)


def make_policy(name: str, cfg: RouterConfig) -> Policy:
    if name == "random":
        return RandomPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy(cfg)
    raise ValueError(f"unknown policy {name!r}")
