"""Prefix reuse over the paged KV cache.

`RadixCache` is a radix tree whose edges are runs of token ids, always a whole number of pages
long: only full pages are ever cached, so a node's KV slots are exactly whole pages that the tree
owns. A request that matches a prefix locks the path (`inc_lock_ref`) so those pages are not
evicted while it runs; unlocked leaves are evicted least recently used first.

Ownership rules (the scheduler relies on them):
* `insert(tokens, slots)` takes ownership of the full pages of `slots` that are new to the tree;
  where the tree already holds that prefix with *different* pages, the caller's duplicate pages
  are freed back to the allocator at once. Pages the caller got from the tree are left alone.
* The caller keeps (and eventually frees) the slots past the last full page.

Events: with a sink set (`events`, a `common.kv_events.KVEventPublisher`), every node carries the
chained hashes of its pages, and each new node, evicted leaf and flush is reported (`stored`,
`removed`, `cleared`); splitting a node changes no block, so it reports nothing.

`ChunkCache` has the same interface and reuses nothing (for `--disable-radix-cache` and decode
nodes): finished requests free everything they hold.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING

import torch

from common.kv_events import chain_hashes
from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from common.scheduler.req import Req

_EMPTY = torch.empty(0, dtype=torch.int64)
_tick = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "hashes")

    def __init__(self, parent: TreeNode | None = None, key: tuple = (), value: torch.Tensor = _EMPTY):
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of this edge (a multiple of page_size)
        self.value = value  # KV slots of those tokens
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.id = next(_tick)
        self.hashes: list[int] = []  # chained block hashes of the key's pages (with an event sink only)

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


class RadixCache:
    enabled = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page size {page_size} != the allocator's {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.events = None  # KV event sink: stored(hashes, parent, tokens), removed(hashes), cleared()
        self.reset()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        """Drop the whole tree (the caller frees the pages first if it wants them back)."""
        self.root = TreeNode()
        self.root.lock_ref = 1  # never evicted
        self._evictable = 0
        self._protected = 0

    def flush(self) -> bool:
        """Free every cached page and reset; refused (False) while any node is locked."""
        if self._protected:
            return False
        events, self.events = self.events, None  # one AllBlocksCleared instead of a removal per leaf
        try:
            self.evict(self._evictable)
        finally:
            self.events = events
        self.reset()
        if events is not None:
            events.cleared()
        return True

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _page_key(self, tokens, start: int) -> tuple:
        return tuple(tokens[start : start + self.page_size])

    def _full_len(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, token_ids) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `token_ids` in whole pages: (its KV slots, the last node)."""
        tokens = list(token_ids)
        node, values = self.root, []
        for node, _, _ in self._walk(tokens, self._full_len(len(tokens))):
            values.append(node.value)
        slots = torch.cat(values) if values else _EMPTY.clone()
        return slots, node

    def _walk(self, tokens: list, n: int):
        """The nodes along the cached prefix of tokens[:n] (whole pages), root excluded, as (node,
        position of its first token, its token count); an edge matched only in part is split first, so
        each node yielded is matched whole. Each is marked accessed now."""
        node, pos, now = self.root, 0, time.monotonic()
        while pos < n:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                return
            k = self._match_len(child.key, tokens, pos, n)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            yield child, pos, k
            pos += k
            node = child

    def _match_len(self, key: tuple, tokens: list, pos: int, end: int) -> int:
        """Tokens of `key` matching tokens[pos:end], in whole pages."""
        ps = self.page_size
        k = 0
        limit = min(len(key), end - pos)
        while k + ps <= limit and key[k : k + ps] == tuple(tokens[pos + k : pos + k + ps]):
            k += ps
        return k

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split `child`'s edge after k tokens; returns the new upper node."""
        parent = child.parent
        upper = TreeNode(parent, child.key[:k], child.value[:k])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[: self.page_size]] = upper
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.parent = upper
        if child.hashes:
            upper.hashes, child.hashes = child.hashes[: k
                                                      // self.page_size], child.hashes[k // self.page_size :]
        upper.children[child.key[: self.page_size]] = child
        return upper

    def insert(self, token_ids, slots: torch.Tensor) -> int:
        """Cache the full pages of `token_ids` (with KV at `slots`).

        Returns how many leading tokens the tree already held (the caller's slots there that
        differ from the tree's have been freed)."""
        tokens = list(token_ids)
        n = self._full_len(min(len(tokens), slots.numel()))
        ps = self.page_size
        node, pos = self.root, 0
        for node, start, k in self._walk(tokens, n):
            self._free_duplicates(node.value, slots[start : start + k])
            pos = start + k
        matched = pos
        if pos < n:
            new = TreeNode(node, tuple(tokens[pos:n]), slots[pos:n].clone())
            new.last_access = time.monotonic()
            node.children[new.key[:ps]] = new
            self._evictable += n - pos
            if self.events is not None:
                parent = node.hashes[-1] if node.hashes else None
                new.hashes = chain_hashes(parent, new.key, ps)
                self.events.stored(new.hashes, parent, new.key)
        return matched

    def _free_duplicates(self, tree_slots: torch.Tensor, own: torch.Tensor) -> None:
        tree_pages = self.allocator.pages_of_slots(tree_slots)
        own_pages = self.allocator.pages_of_slots(own)
        dup = own_pages[own_pages != tree_pages]
        if dup.numel():
            self.allocator.free_pages(dup)

    # ------------------------------------------------------------------ locking
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Protect the path root..node from eviction; returns tokens newly protected."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one inc_lock_ref; returns tokens that became evictable."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unbalanced dec_lock_ref on {node}")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` cached tokens (if that many are evictable), least recently
        used unlocked leaves first. Returns tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free_slots(leaf.value)
            if self.events is not None:
                self.events.removed(leaf.hashes)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ request hooks
    def _insert_computed(self, req: Req) -> tuple[list[int], torch.Tensor, int]:
        """Insert the full pages of what the request computed; returns its tokens, its slots (a copy) and
        how many of them the tree now holds."""
        kv_len = req.kv_len
        tokens = req.all_token_ids()[:kv_len]
        slots = self.req_to_token_pool.slots(req.req_pool_idx, 0, kv_len).clone()
        full = self._full_len(kv_len)
        self.insert(tokens[:full], slots[:full])
        return tokens, slots, full

    def cache_finished_req(self, req: Req) -> None:
        """The request is done (or retracted): cache its full pages, free the rest and its row."""
        _, slots, full = self._insert_computed(req)
        self.allocator.free_slots(slots[full:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.release_kv_state()

    def cache_unfinished_req(self, req: Req) -> None:
        """Cache what the request computed so far and make it hold the tree's slots for it."""
        row = req.req_pool_idx
        tokens, slots, full = self._insert_computed(req)
        new_slots, new_node = self.match_prefix(tokens[:full])
        if new_slots.numel() != full:
            raise RuntimeError(f"req {req.rid}: re-match found {new_slots.numel()} of {full} tokens")
        self.req_to_token_pool.write(row, 0, new_slots)
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([new_slots, slots[full:]])
        req.last_node = new_node
        req.locked_len = full

    def release_req(self, req: Req) -> None:
        """Free a request's KV without caching it (abort, failed transfer)."""
        row = req.req_pool_idx
        kv_len = req.kv_len
        slots = self.req_to_token_pool.slots(row, 0, kv_len)
        self.allocator.free_slots(slots[req.locked_len:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.release_kv_state()

    # ------------------------------------------------------------------ debug
    def pretty(self) -> str:
        lines = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{child.key[:8]}{'...' if len(child.key) > 8 else ''} "
                             f"len={len(child.key)} lock={child.lock_ref}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)


class ChunkCache:
    """Same interface as RadixCache, no reuse: a request's slots are its own until it ends."""

    enabled = False

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 page_size: int) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.root = None

    def reset(self) -> None:
        pass

    def flush(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def match_prefix(self, token_ids) -> tuple[torch.Tensor, None]:
        return _EMPTY.clone(), None

    def insert(self, token_ids, slots: torch.Tensor) -> int:
        return 0

    def inc_lock_ref(self, node) -> int:
        return 0

    def dec_lock_ref(self, node) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_finished_req(self, req: Req) -> None:
        self.release_req(req)

    def cache_unfinished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.slots(row, 0, req.kv_len).clone()

    def release_req(self, req: Req) -> None:
        row = req.req_pool_idx
        self.allocator.free_slots(self.req_to_token_pool.slots(row, 0, req.kv_len))
        self.req_to_token_pool.free(row)
        req.release_kv_state()

    def pretty(self) -> str:
        return ""


def make_tree_cache(enabled: bool, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                    page_size: int) -> RadixCache | ChunkCache:
    cls = RadixCache if enabled else ChunkCache
    return cls(req_to_token_pool, allocator, page_size)
