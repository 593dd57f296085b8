"""ForwardBatch: what one model forward needs, independent of how the scheduler built it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from common.memory.kv_pool import KVPool

# the int64 tensors of a batch that follow it to the device (`ForwardBatch.to_device`)
_INDEX_TENSORS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices",
                  "logits_indices", "state_indices")


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens, possibly on top of a cached prefix (chunked prefill too)
    DECODE = 2  # one new token per request
    # speculative decoding: per request its last token + draft tokens on top of its KV, logits of every
    # new token (attention runs it as an extend; common/scheduler/speculative.py)
    VERIFY = 3


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64, rows of ReqToTokenPool
    seq_lens: list[int]  # [B] tokens per request after this forward (prefix + new)
    extend_prefix_lens: list[int]  # [B] tokens already in the KV cache before this forward
    extend_seq_lens: list[int]  # [B] new tokens per request (all 1 in DECODE)
    kv_pool: KVPool
    req_to_token: torch.Tensor  # ReqToTokenPool.req_to_token
    # rows of the hidden states whose logits are needed, in output order: by default the last
    # new token of each request; every new token when prompt logprobs are asked for
    logits_indices: torch.Tensor | None = None
    # per request state slot (hybrid models), else None
    state_indices: torch.Tensor | None = None
    # filled by the attention backend's init_forward_metadata
    attn_metadata: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    def to_device(self, device: torch.device) -> None:
        """Move the batch's index tensors (built on the host by the scheduler) to `device`, in place, with one
        copy: they are packed into one pinned host buffer, sent without blocking, and split there."""
        if device.type == "cpu":
            return
        names = [n for n in _INDEX_TENSORS if (t := getattr(self, n)) is not None and t.device != device]
        if not names:
            return
        parts = [getattr(self, n) for n in names]
        packed = torch.cat([t.reshape(-1).to(torch.int64) for t in parts]).pin_memory()
        moved = packed.to(device, non_blocking=True).split([t.numel() for t in parts])
        for n, t, m in zip(names, parts, moved, strict=True):
            setattr(self, n, m.view(t.shape))

    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.extend_seq_lens, dtype=torch.int64, device=self.input_ids.device).cumsum(0)
        return ends - 1

    def token_slices(self, n: int) -> list[ForwardBatch]:
        """An EXTEND batch as `n` consecutive ranges of its new tokens, to run one after the other (a
        pipeline stage hands each on while it runs the next). A request cut between two ranges goes on
        in the next with the first part as its prefix: its KV is in the pool by then. Each range keeps
        the `logits_indices` inside it (local), so the ranges' logits, concatenated, are the batch's;
        they must be in increasing order (the scheduler's are). A hybrid model's state slots go with their
        requests (the state after the first part is in the slot when the next range runs)."""
        total = self.input_ids.numel()
        bounds = [round(i * total / n) for i in range(n + 1)]
        starts = [0]
        for m in self.extend_seq_lens:
            starts.append(starts[-1] + m)
        idx = self.logits_indices
        out = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            rows, prefix, lens = [], [], []
            for i, (s, p) in enumerate(zip(starts, self.extend_prefix_lens, strict=False)):
                a, b = max(s, lo), min(starts[i + 1], hi)
                if a < b:
                    rows.append(i)
                    prefix.append(p + a - s)
                    lens.append(b - a)
            local = None if idx is None else idx[(idx >= lo) & (idx < hi)] - lo
            out.append(ForwardBatch(
                self.mode, self.input_ids[lo:hi], self.positions[lo:hi], self.out_cache_loc[lo:hi],
                self.req_pool_indices[rows], [p + m for p, m in zip(prefix, lens, strict=True)], prefix, lens,
                self.kv_pool, self.req_to_token, logits_indices=local,
                state_indices=None if self.state_indices is None else self.state_indices[rows]))
        return out
