"""Approximate prefix tree of the request texts routed to one worker (cache_aware policy).

A character-level radix tree: edges carry strings, every node remembers when it was last touched, and
eviction removes the least recently used leaves until the tree holds at most `max_size` characters.
It approximates the worker's KV prefix cache without asking the worker.
"""

from __future__ import annotations

import heapq
import itertools
import time


def common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]; slice compares run in C
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Node:
    __slots__ = ("text", "children", "parent", "last_access")

    def __init__(self, text: str, parent: Node | None):
        self.text = text
        self.children: dict[str, Node] = {}
        self.parent = parent
        self.last_access = time.monotonic()


class PrefixTree:
    def __init__(self):
        self.root = Node("", None)
        self.size = 0  # characters stored

    def match(self, text: str) -> int:
        """Length of the longest stored prefix of `text`; touches the nodes it walks."""
        node, i, now = self.root, 0, time.monotonic()
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            edge = child.text
            k = common_prefix_len(edge, text[i:i + len(edge)])
            child.last_access = now
            i += k
            if k < len(edge):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        node, i, now = self.root, 0, time.monotonic()
        node.last_access = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = Node(text[i:], node)
                leaf.last_access = now
                node.children[text[i]] = leaf
                self.size += len(text) - i
                return
            edge = child.text
            k = common_prefix_len(edge, text[i:i + len(edge)])
            if k < len(edge):  # split the edge at k
                mid = Node(edge[:k], node)
                mid.last_access = now
                child.text = edge[k:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[edge[0]] = mid
                child = mid
            child.last_access = now
            i += k
            node = child

    def evict(self, max_size: int) -> int:
        """Drop least recently used leaves until at most `max_size` characters remain; returns chars freed."""
        if self.size <= max_size:
            return 0
        freed, tie = 0, itertools.count()
        heap = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                heap.append((n.last_access, next(tie), n))
        heapq.heapify(heap)
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.text[0]]
            self.size -= len(leaf.text)
            freed += len(leaf.text)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return freed
