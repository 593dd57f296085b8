"""ReqToTokenPool: one row per live request, mapping token position -> KV slot index."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the KV slot (page * page_size + offset) of token `pos`.

    Rows are handed out per request and returned when it ends; slot 0 of the KV pool is a
    padding slot, so zeros in unused columns are harmless to gather. The table lives where the KV pool
    does (`device`): attention reads it on every step; the scheduler writes a few slots per step (`write`,
into the device table and, for a device table, into its host copy, which `slots` reads).

    Hybrid models (linear-attention layers with per-request state) attach a `StatePool`
    (`attach_state_pool`): then every row carries one state slot, taken with the row in `alloc()` and
    returned with it in `free()`, and `state_indices(rows)` maps rows to their slots.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=self.device)
        # a device table's host copy: the books (allocator, radix cache, transfer) read slots without waiting
        # for the device (a read of the device table would wait for every kernel launched before it)
        self._host = self.req_to_token if self.device.type == "cpu" else torch.zeros(size, max_context_len,
                                                                                      dtype=torch.int64)
        self._free: list[int] = list(range(size))
        self.state_pool = None
        # state slot of each row (0: none), beside the table: the forward indexes it with the batch's rows
        self.row_state = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._state_of = [0] * size  # the same on the host

    def attach_state_pool(self, state_pool) -> None:
        """Give every row a state slot from now on (the state pool must have a slot per row)."""
        if len(self._free) != self.size:
            raise RuntimeError("attach the state pool before any row is handed out")
        if state_pool.available_size() < self.size:
            raise ValueError(f"the state pool has {state_pool.available_size()} slots for {self.size} rows")
        self.state_pool = state_pool

    def state_indices(self, rows: torch.Tensor) -> torch.Tensor:
        return self.row_state[rows]

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        if self.state_pool is not None:
            self._state_of[row] = self.state_pool.alloc()
            self.row_state[row] = self._state_of[row]
        return row

    def state_of(self, row: int) -> int:
        """The row's state slot (0: none)."""
        return self._state_of[row]

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} is not in this pool")
        if self.state_pool is not None:
            self.state_pool.free(self._state_of[row])
            self._state_of[row] = 0
            self.row_state[row] = 0
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        end = start + slots.numel()
        self.req_to_token[row, start:end] = slots
        if self._host is not self.req_to_token:
            self._host[row, start:end] = slots

    def write_at(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """One slot per (row, position) pair (a decode step's next tokens), into the table and its host
        copy."""
        self.req_to_token[rows, positions] = slots.to(self.device)
        if self._host is not self.req_to_token:
            self._host[rows, positions] = slots.cpu()

    def slots_at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The slots of (row, position) pairs, read on the host (see `slots`)."""
        return self._host[rows, positions]

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """A row's slots `start..end-1` on the host, as the allocator, the radix cache and the transfer layer
        keep their books: a view of the table on the CPU, of its host copy when the table is on a device
        (no wait for the device)."""
        return self._host[row, start:end]
