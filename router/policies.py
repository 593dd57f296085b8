"""Worker selection: random, round_robin, power_of_two and cache_aware (sglang-router's rules); with
`--kv-events`, cache_aware routes prefill requests by the workers' exact cached blocks
(router/kv_index.py)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from router.config import RouterConfig
from router.registry import Worker
from router.tree import PrefixTree

log = logging.getLogger("router.policies")


class Policy:
    name = ""
    needs_text = False
    prepares = False  # `await prepare(req)` gives the routing key `select` takes instead of the text

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

    def imbalanced(self, workers) -> Worker | None:
        """The least loaded worker when the loads are imbalanced beyond the thresholds."""
        loads = [w.active for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs and hi > lo * self.rel:
            return workers[loads.index(lo)]
        return None

    def select(self, workers, text):
        text = text or ""
        if len(workers) == 1:
            chosen = workers[0]
        else:
            chosen = self.imbalanced(workers)
            if chosen is None:
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


class RouteKey:
    """What the exact policy routes one request by: its text (for the approximate fallback), the ids the
    prefill node will compute, and their chained page hashes per page size. `select` notes in `group`
    the chosen worker's DP group holding the prefix (None: any group), for the dispatcher's room."""

    __slots__ = ("text", "ids", "hashes", "group")

    def __init__(self, text: str | None, ids: list[int] | None, hashes: dict[int, list[int]]):
        self.text, self.ids, self.hashes = text, ids, hashes
        self.group: int | None = None


# prompts up to this many characters (or ids) are tokenized and hashed on the event loop (well under a
# millisecond); longer ones on the policy's thread pool, so a huge prompt never stalls other requests
INLINE_ROUTE_SIZE = 2048


class KVEventsCacheAwarePolicy(CacheAwarePolicy):
    """cache_aware with `--kv-events`, for prefill workers: the prompt is tokenized as the node does
    (router/tokenizer.py) and hashed into chained pages as the node's KV events are (common/kv_events.py);
    the worker holding the longest prefix of those pages in tokens wins. Its view is the blocks its events
    reported, plus the pages of requests routed to it in the last `--kv-events-pending-secs` seconds that
    its events have not confirmed yet (their prefill may still run). The load rules stay sglang-router's:
    imbalanced loads take the least loaded worker; no match takes the least loaded one, then the one with
    the fewest cached blocks. A worker with DP groups has a view per group (each group caches on its
    own): its best group counts, and the request is pinned to it (`RouteKey.group`; with no match, to
    the group routed the fewest pages lately). Workers without
    events (no endpoint in their /server_info, or no tokenizer in the router) are routed by the
    approximate tree, as plain cache_aware."""

    name = "cache_aware"
    prepares = True

    def __init__(self, cfg: RouterConfig, index, tokenizer_source):
        super().__init__(cfg)
        self.index = index
        self.tokenizer_source = tokenizer_source  # () -> LightTokenizer | None
        self.pending_secs = cfg.kv_events_pending_secs
        self.recent: dict[str, dict[int, float]] = {}
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="route-tokenize")
        self.counts = {"exact": 0, "exact_hits": 0, "approximate": 0, "load": 0}

    async def prepare(self, req) -> RouteKey:
        from router.tokenizer import prompt_source, source_size, tokenize

        src = prompt_source(req.path, req.obj)
        if src is None:
            return RouteKey(req.text, None, {})
        tok = self.tokenizer_source() if src[0] != "ids" else None
        sizes = {v.page_size for v in list(self.index.views.values())}

        def work() -> RouteKey:
            from common.kv_events import chain_hashes

            ids = tokenize(tok, *src)
            try:
                hashes = {ps: chain_hashes(None, ids, ps) for ps in sizes} if ids else {}
            # ids no node takes (it answers 400): route by text
            except (struct.error, OverflowError, ValueError, TypeError):
                ids, hashes = None, {}
            return RouteKey(req.text, ids, hashes)

        if source_size(*src) <= INLINE_ROUTE_SIZE:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    def _recent(self, view_key: str) -> dict[int, float]:
        r = self.recent.get(view_key)
        if r is None:
            r = self.recent[view_key] = {}
        return r

    def _matched_tokens(self, key: RouteKey, view, now: float) -> int:
        hashes = self._hashes(key, view.page_size)
        recent = self.recent.get(view.key)
        live = {h for h in hashes if recent.get(h, 0.0) > now} if recent else None
        return view.matched_blocks(hashes, live) * view.page_size

    def _best_view(self, key: RouteKey, views, now: float):
        """(tokens, view) of the group of one worker holding the longest prefix (the first on a tie)."""
        return max(((self._matched_tokens(key, v, now), v) for v in views), key=lambda tv: tv[0])

    def select(self, workers, key):
        if not isinstance(key, RouteKey):
            return super().select(workers, key)
        key.group = None
        views = [self.index.views_of(w.url) for w in workers]
        if key.ids is None or not all(views):
            self.counts["approximate"] += 1
            return super().select(workers, key.text)
        now = time.monotonic()
        if len(workers) == 1:
            chosen = workers[0]
        else:
            chosen = self.imbalanced(workers)
            if chosen is None:
                best, best_tokens = None, 0
                for w, vs in zip(workers, views, strict=True):
                    tokens = self._best_view(key, vs, now)[0]
                    if tokens > best_tokens or (tokens == best_tokens and best is not None
                                                and tokens and w.active < best.active):
                        best, best_tokens = w, tokens
                if best is not None:
                    chosen = best
                    self.counts["exact_hits"] += 1
                else:
                    chosen = min(workers,
                                 key=lambda w: (w.active, sum(len(v.blocks) + len(self.recent.get(v.key, ()))
                                                              for v in self.index.views_of(w.url))))
            else:
                self.counts["load"] += 1
        self.counts["exact"] += 1
        chosen_views = self.index.views_of(chosen.url)
        tokens, view = self._best_view(key, chosen_views, now)
        if len(chosen_views) > 1:  # the group holding the prefix, else the one routed the fewest pages lately
            if not tokens:
                view = min(chosen_views, key=lambda v: len(self.recent.get(v.key, ())))
            key.group = view.dp_rank
        if self.pending_secs > 0:
            until = now + self.pending_secs
            recent = self._recent(view.key)
            if len(recent) > view.max_blocks:
                recent.clear()
            for h in self._hashes(key, view.page_size):
                recent[h] = until
        return chosen

    @staticmethod
    def _hashes(key: RouteKey, page_size: int) -> list[int]:
        hashes = key.hashes.get(page_size)
        if hashes is None and key.ids:  # a page size learned after the request was prepared
            from common.kv_events import chain_hashes

            hashes = key.hashes[page_size] = chain_hashes(None, key.ids, page_size)
        return hashes or []

    def forget(self, url):
        super().forget(url)
        for view_key in [k for k in self.recent if k == url or k.startswith(url + "#dp")]:
            del self.recent[view_key]

    def evict(self):
        super().evict()
        now = time.monotonic()
        for url, recent in list(self.recent.items()):
            self.recent[url] = {h: t for h, t in recent.items() if t > now}


def make_policy(name: str, cfg: RouterConfig, index=None, tokenizer_source=None) -> Policy:
    if name == "random":
        return RandomPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "cache_aware":
        if index is not None:
            return KVEventsCacheAwarePolicy(cfg, index, tokenizer_source)
        return CacheAwarePolicy(cfg)
    raise ValueError(f"unknown policy {name!r}")
