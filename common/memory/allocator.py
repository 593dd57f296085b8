"""Paged KV slot allocator.

Memory is handed out in pages of `page_size` token slots (the arithmetic is `PageLayout`'s). Page 0
is reserved as the padding page (gathers of unused positions read it, writes of padded tokens land
in it), so real pages are 1..num_pages-1. A request's tokens fill its last page before a new page is
taken, so its pages are exactly the distinct pages of its slots.
"""

from __future__ import annotations

import torch

from common.memory.paging import PageLayout


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation (the caller retracts or waits)."""


class TokenToKVPoolAllocator(PageLayout):
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is padding)")
        super().__init__(page_size)
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    # ---- pages
    def available_pages(self) -> int:
        return len(self._free)

    def available_size(self) -> int:
        """Free token slots."""
        return len(self._free) * self.page_size

    @property
    def capacity(self) -> int:
        """Token slots a request can ever use (all real pages)."""
        return (self.num_pages - 1) * self.page_size

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free_pages(self, pages) -> None:
        pages = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        if any(p <= 0 or p >= self.num_pages for p in pages):
            raise ValueError(f"freeing pages outside the pool: {pages}")
        self._free.extend(pages)

    # ---- token slots
    def alloc_extend(self, cur_len: int, last_slot: int, n: int) -> torch.Tensor:
        """Slots for tokens cur_len .. cur_len+n-1 of one request.

        `last_slot` is the slot of token cur_len-1 (ignored when cur_len is page aligned)."""
        ps = self.page_size
        room = (-cur_len) % ps
        use = min(room, n)
        head = torch.arange(last_slot + 1, last_slot + 1 + use, dtype=torch.int64)
        rest = n - use
        if rest == 0:
            return head
        tail = self.slots_of_pages(self.alloc_pages(self.pages_for(rest)), rest)
        return torch.cat([head, tail]) if use else tail

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free every page that the given slots touch (the request owns them all)."""
        if slots.numel() == 0:
            return
        self.free_pages(torch.unique(self.page_of(slots)))
