"""DecodeReqToTokenPool: request rows split between running requests and preallocated ones.

A decode node holds rows for two kinds of requests: those decoding (the running batch, and retracted
requests re-prefilling on their way back into it) and those whose KV is on its way (prealloc,
transfer, and received-but-waiting requests). The pool has `max_running_requests + prealloc_size`
rows and keeps two budgets:

* `#running <= max_running_requests` (`alloc()`, what the base scheduler's batches use);
* `#preallocated <= prealloc_size` (`alloc_prealloc()`), held in the extra rows,

so preallocation can never take the rows running (or retracted) requests need, and a burst of
running requests can never block the transfers already admitted. `promote(row)` moves a row whose
request joins the running batch from the preallocated budget to the running one. The table lives
where the node computes (`device`), like the pool it replaces.
"""

from __future__ import annotations

import torch

from common.memory.req_to_token import ReqToTokenPool


class DecodeReqToTokenPool(ReqToTokenPool):
    def __init__(self, max_running_requests: int, prealloc_size: int, max_context_len: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(max_running_requests + prealloc_size, max_context_len, device=device)
        self.max_running_requests = max_running_requests
        self.prealloc_size = prealloc_size
        self._kind: dict[int, str] = {}  # row -> "running" | "prealloc"
        self.running_used = 0
        self.prealloc_used = 0

    def available_size(self) -> int:
        """Rows a running (or re-prefilling) request can still get."""
        return min(self.max_running_requests - self.running_used, len(self._free))

    def prealloc_available(self) -> int:
        return min(self.prealloc_size - self.prealloc_used, len(self._free))

    def _take(self, kind: str) -> int | None:
        row = super().alloc()
        if row is None:
            return None
        self._kind[row] = kind
        if kind == "running":
            self.running_used += 1
        else:
            self.prealloc_used += 1
        return row

    def alloc(self) -> int | None:
        if self.available_size() <= 0:
            return None
        return self._take("running")

    def alloc_prealloc(self) -> int | None:
        if self.prealloc_available() <= 0:
            return None
        return self._take("prealloc")

    def can_promote(self) -> bool:
        return self.running_used < self.max_running_requests

    def promote(self, row: int) -> None:
        if self._kind.get(row) != "prealloc":
            raise ValueError(f"row {row} is not a preallocated row")
        if not self.can_promote():
            raise RuntimeError(f"all {self.max_running_requests} running rows are in use")
        self._kind[row] = "running"
        self.prealloc_used -= 1
        self.running_used += 1

    def free(self, row: int) -> None:
        kind = self._kind.pop(row, None)
        if kind is None:
            raise ValueError(f"row {row} is not allocated")
        if kind == "running":
            self.running_used -= 1
        else:
            self.prealloc_used -= 1
        super().free(row)
