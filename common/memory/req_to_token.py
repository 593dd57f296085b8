"""ReqToTokenPool: one row per live request, mapping token position -> KV slot index."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the KV slot (page * page_size + offset) of token `pos`.

    Rows are handed out per request and returned when it ends; slot 0 of the KV pool is a
    padding slot, so zeros in unused columns are harmless to gather.
    """

    def __init__(self, size: int, max_context_len: int) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} is not in this pool")
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[row, start:end]
