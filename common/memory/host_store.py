"""HostKVStore: where a retracted request's KV waits until it runs again (`--decode-offload-size`).

When the scheduler retracts a decoding request (KV memory ran out), the request's pages (every
layer's K and V) are copied here before they are freed, and copied back into fresh pages when it is
scheduled again: it resumes decoding with no prefill forward. Without an entry (the store was off,
too small, or the entry was evicted) the request re-prefills prompt + output, as before.

* The store is its own pool with its own budget, separate from the KV pool: `capacity_pages` pages in
  the KV pool's page layout (`[pages, 2, layers, kv_heads, page_size, head_dim]`), so one page of
  every layer's K and V is one contiguous region on both sides and a run of pages that is consecutive
  on both sides is one copy. On a CPU node the "device" is the CPU too; on a GPU node the store is
  pageable host memory and its copies to and from the device are synchronous (pinning would touch the
  whole budget up front). The buffer is `torch.empty`, so the OS backs only the pages that were ever
  written.
* Hybrid models: each entry also keeps the request's recurrent/conv state slot (every buffer of the
  `StatePool`), in a host state array with one slot per request row of the node (on top of the token
  budget: a slot has a fixed size).
* Entries are keyed by rid; when a new entry does not fit, the least recently stored entries are
  evicted (their requests will recompute). An entry larger than the whole store is not stored.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch


@dataclass
class HostEntry:
    pages: list[int]  # host pages, in the request's page order
    kv_len: int  # tokens of KV they hold
    state_slot: int | None = None  # host state slot (hybrid models)


def copy_pages(dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int]) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]] (page-first tensors), one copy per run of pages that is
    consecutive on both sides."""
    n = len(dst_pages)
    i = 0
    while i < n:
        j = i + 1
        while j < n and dst_pages[j] == dst_pages[j - 1] + 1 and src_pages[j] == src_pages[j - 1] + 1:
            j += 1
        d, s = dst_pages[i], src_pages[i]
        dst[d : d + j - i].copy_(src[s : s + j - i])
        i = j


class HostKVStore:
    def __init__(self, capacity_tokens: int, kv_pool, state_pool=None, state_slots: int = 0) -> None:
        self.page_size = kv_pool.page_size
        self.capacity_pages = capacity_tokens // self.page_size
        if self.capacity_pages < 1:
            raise ValueError(f"a host KV store needs at least one page ({self.page_size} tokens), got "
                             f"{capacity_tokens} tokens")
        self.kv_pool = kv_pool
        self.data = torch.empty((self.capacity_pages, *kv_pool.data.shape[1:]), dtype=kv_pool.data.dtype)
        self._free: list[int] = list(range(self.capacity_pages - 1, -1, -1))  # pop(): low pages first
        self.state_pool = state_pool
        self.state: list[torch.Tensor] = []
        self._free_states: list[int] = []
        if state_pool is not None:
            if state_slots < 1:
                raise ValueError("a host KV store for a model with state needs state slots")
            self.state = [torch.empty((state_slots, *b.shape[1:]), dtype=b.dtype)
                          for b in state_pool.buffers()]
            self._free_states = list(range(state_slots - 1, -1, -1))
        self.entries: collections.OrderedDict[str, HostEntry] = collections.OrderedDict()  # oldest first
        self.evictions = 0  # entries dropped to make room for newer ones
        self.rejected = 0  # entries larger than the whole store

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    def used_pages(self) -> int:
        return self.capacity_pages - len(self._free)

    def used_tokens(self) -> int:
        """Token slots the entries hold (whole pages)."""
        return self.used_pages() * self.page_size

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() \
            + sum(t.numel() * t.element_size() for t in self.state)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def kv_len(self, key: str) -> int:
        return self.entries[key].kv_len

    # ------------------------------------------------------------------ store / load
    def store(self, key: str, device_pages: list[int], kv_len: int, state_slot: int | None = None) -> bool:
        """Copy a request's pages (and its state slot) in; False if it can never fit (nothing stored).
        Older entries are evicted to make room."""
        n = len(device_pages)
        if key in self.entries:
            raise ValueError(f"{key} is already in the host KV store")
        if n > self.capacity_pages:
            self.rejected += 1
            return False
        needs_state = self.state_pool is not None
        while len(self._free) < n or (needs_state and not self._free_states):
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        copy_pages(self.data, pages, self.kv_pool.data, device_pages)
        slot = None
        if needs_state:
            slot = self._free_states.pop()
            for host, dev in zip(self.state, self.state_pool.buffers(), strict=True):
                host[slot].copy_(dev[state_slot])
        self.entries[key] = HostEntry(pages, kv_len, slot)
        return True

    def load(self, key: str, device_pages: list[int], state_slot: int | None = None) -> int:
        """Copy an entry back into `device_pages` (as many as it holds) and its state into `state_slot`;
        the entry is gone afterwards. Returns its kv_len."""
        e = self.entries[key]
        if len(device_pages) != len(e.pages):
            raise ValueError(f"{key}: {len(e.pages)} pages stored, {len(device_pages)} given")
        copy_pages(self.kv_pool.data, device_pages, self.data, e.pages)
        if e.state_slot is not None:
            for host, dev in zip(self.state, self.state_pool.buffers(), strict=True):
                dev[state_slot].copy_(host[e.state_slot])
        self._drop(key)
        return e.kv_len

    def discard(self, key: str) -> None:
        """Forget an entry (its request ended); unknown keys are a no-op."""
        if key in self.entries:
            self._drop(key)

    def _drop(self, key: str) -> None:
        e = self.entries.pop(key)
        self._free.extend(e.pages)
        if e.state_slot is not None:
            self._free_states.append(e.state_slot)

    @staticmethod
    def off_stats() -> dict:
        """`stats()` of a node without a store (the same keys, all zero)."""
        return {"decode_offload_capacity_tokens": 0, "decode_offload_used_tokens": 0,
                "decode_offload_entries": 0, "decode_offload_evictions": 0, "decode_offload_rejected": 0}

    def stats(self) -> dict:
        return {"decode_offload_capacity_tokens": self.capacity_tokens,
                "decode_offload_used_tokens": self.used_tokens(),
                "decode_offload_entries": len(self.entries),
                "decode_offload_evictions": self.evictions,
                "decode_offload_rejected": self.rejected}
