"""Page <-> slot arithmetic, in one place.

KV memory is cut into pages of `page_size` token slots: slot `s` is offset `s % page_size` of page
`s // page_size`. A request's tokens fill its last page before it takes a new one, so token `i` of a
request sits at offset `i % page_size` of its page and its pages are `slots[::page_size] // page_size`.
The allocator and the KV pool are both `PageLayout`s; nothing else writes this arithmetic out.
"""

from __future__ import annotations

import torch


class PageLayout:
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    # ---- token counts
    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold `n_tokens` tokens (the last one possibly partial)."""
        return -(-n_tokens // self.page_size)

    def full_pages(self, n_tokens: int) -> int:
        """Whole pages among `n_tokens` tokens."""
        return n_tokens // self.page_size

    def pages_needed(self, cur_len: int, n: int) -> int:
        """Pages a request holding `cur_len` tokens needs to grow by `n` tokens."""
        return self.pages_for(cur_len + n) - self.pages_for(cur_len)

    # ---- pages -> slots
    def first_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """The slot at offset 0 of each page."""
        return pages * self.page_size

    def slots_of_pages(self, pages, n_tokens: int | None = None) -> torch.Tensor:
        """Every slot of `pages` in order (a list or an int64 tensor), cut to the first `n_tokens`."""
        pages = pages if isinstance(pages, torch.Tensor) else torch.tensor(pages, dtype=torch.int64)
        slots = (pages[:, None] * self.page_size + self._offsets).flatten()
        return slots if n_tokens is None else slots[:n_tokens]

    # ---- slots -> pages
    def page_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The page of every slot."""
        return slots // self.page_size

    def offset_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The offset of every slot within its page."""
        return slots % self.page_size

    def pages_of_slots(self, slots: torch.Tensor, start_page: int = 0,
                       end_page: int | None = None) -> torch.Tensor:
        """Pages `start_page..end_page-1` (all by default) of a request whose token `i` is at `slots[i]`
        (a req_to_token row will do), one per page, in order."""
        ps = self.page_size
        end = None if end_page is None else end_page * ps
        return slots[start_page * ps : end : ps] // ps
