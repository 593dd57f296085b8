"""Per-request first-token metadata that travels with the last KV chunk, and its slot allocator.

`MetadataBuffers(size)` keeps one tensor per field with `size` rows (slots); every row is padded to at
least 64 bytes so rows never share a cache line and each row is one transfer region. The prefill
node fills its slot after the forward pass (`set_buf`), the sender writes the row into the decode
rank's slot of the same buffers, and the decode receiver checks that the row's `bootstrap_room`
equals its own room before it reports Success (`get_room`).

The rows are always host memory (the decode side's CPU reads them); on a node whose KV is on a GPU
they are pinned (`pinned=True`), page-locked memory that the engines' device transports can also reach.

Fields per slot: first output token id, cached tokens, the token's logprob value / index, top
logprobs values / indices, speculative decoding top-k p / index and the hidden state, and the room.

`set_buf` refuses values its int32 / int64 fields cannot hold (ValueError naming the field), so one
request's bad value fails that request only. The decode side treats a received row as a peer value:
`check_row` names the first field out of range (first token and top-logprob ids within the
vocabulary, cached tokens within the prompt, logprob values finite or -inf, the sentinel of a token
with probability 0).
"""

from __future__ import annotations

import math
import threading

import torch

_MIN_ROW_BYTES = 64
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _fits(name: str, value, bounds: tuple[int, int]) -> int:
    v = int(value)
    if not bounds[0] <= v <= bounds[1]:
        raise ValueError(f"metadata {name} = {v} does not fit its "
                         f"{'int32' if bounds == _INT32 else 'int64'} field")
    return v


def _row_len(n: int, dtype: torch.dtype) -> int:
    """Elements per row so that a row holds `n` values and is at least 64 bytes (a multiple of 64)."""
    per = _MIN_ROW_BYTES // torch.tensor([], dtype=dtype).element_size()
    return max(per, -(-n // per) * per)


class MetadataBuffers:
    FIELDS = ("output_ids", "cached_tokens", "logprob_val", "logprob_idx", "top_logprobs_val",
              "top_logprobs_idx", "topk_p", "topk_index", "hidden_states", "bootstrap_room")

    def __init__(self, size: int, max_top_logprobs: int = 20, hidden_size: int = 0, spec_topk: int = 1,
                 hidden_dtype: torch.dtype = torch.float32, pinned: bool = False) -> None:
        self.size = size
        self.max_top_logprobs = max_top_logprobs
        self.hidden_size = hidden_size
        self.spec_topk = spec_topk
        specs = {
            "output_ids": (1, torch.int32),
            "cached_tokens": (1, torch.int32),
            "logprob_val": (1, torch.float32),
            "logprob_idx": (1, torch.int32),
            "top_logprobs_val": (max_top_logprobs, torch.float32),
            "top_logprobs_idx": (max_top_logprobs, torch.int32),
            "topk_p": (spec_topk, torch.float32),
            "topk_index": (spec_topk, torch.int64),
            "hidden_states": (hidden_size, hidden_dtype),
            "bootstrap_room": (1, torch.int64),
        }
        self._tensors: dict[str, torch.Tensor] = {
            name: torch.zeros((size, _row_len(n, dt)), dtype=dt) for name, (n, dt) in specs.items()}
        if pinned:  # a node on a GPU: page-locked, so a device transport can read and write the rows directly
            self._tensors = {name: t.pin_memory() for name, t in self._tensors.items()}
        self.room_index = self.FIELDS.index("bootstrap_room")

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def buffers(self) -> list[tuple[int, int, int]]:
        """(ptr, nbytes, row_bytes) of every field, in FIELDS order, for engine registration."""
        out = []
        for name in self.FIELDS:
            t = self._tensors[name]
            out.append((t.data_ptr(), t.numel() * t.element_size(), t.shape[1] * t.element_size()))
        return out

    def set_buf(self, slot: int, first_token_id: int, cached_tokens: int = 0, logprob_val: float = 0.0,
                logprob_idx: int = 0, top_vals=None, top_idxs=None, room: int = 0, topk_p=None,
                topk_index=None, hidden_state=None) -> None:
        t = self._tensors
        room = _fits("bootstrap_room", room, _INT64)
        t["output_ids"][slot, 0] = _fits("first_token_id", first_token_id, _INT32)
        t["cached_tokens"][slot, 0] = _fits("cached_tokens", cached_tokens, _INT32)
        t["logprob_val"][slot, 0] = float(logprob_val)
        t["logprob_idx"][slot, 0] = _fits("logprob_idx", logprob_idx, _INT32)
        for name, values, cap in (("top_logprobs_val", top_vals, self.max_top_logprobs),
                                  ("top_logprobs_idx", top_idxs, self.max_top_logprobs),
                                  ("topk_p", topk_p, self.spec_topk),
                                  ("topk_index", topk_index, self.spec_topk),
                                  ("hidden_states", hidden_state, self.hidden_size)):
            row = t[name][slot]
            row.zero_()
            if values is not None:
                v = torch.as_tensor(values).flatten()
                if v.numel() > cap:
                    raise ValueError(f"{name}: {v.numel()} values, the buffer holds {cap}")
                row[: v.numel()] = v.to(row.dtype)
        t["bootstrap_room"][slot, 0] = room

    def get_buf(self, slot: int) -> dict:
        t = self._tensors
        return {
            "first_token_id": int(t["output_ids"][slot, 0]),
            "cached_tokens": int(t["cached_tokens"][slot, 0]),
            "logprob_val": float(t["logprob_val"][slot, 0]),
            "logprob_idx": int(t["logprob_idx"][slot, 0]),
            "top_vals": t["top_logprobs_val"][slot, : self.max_top_logprobs].clone(),
            "top_idxs": t["top_logprobs_idx"][slot, : self.max_top_logprobs].clone(),
            "topk_p": t["topk_p"][slot, : self.spec_topk].clone(),
            "topk_index": t["topk_index"][slot, : self.spec_topk].clone(),
            "hidden_state": t["hidden_states"][slot, : self.hidden_size].clone(),
            "room": int(t["bootstrap_room"][slot, 0]),
        }

    def get_room(self, slot: int) -> int:
        return int(self._tensors["bootstrap_room"][slot, 0])

    def check_row(self, slot: int, vocab_size: int, prompt_len: int, logprob: bool = False,
                  top_k: int = 0, draft: bool = False) -> str | None:
        """None if the row's fields a decode uses are in range: the first token id within the
        vocabulary, cached tokens within the prompt, and when asked the logprob and the first `top_k`
        top logprobs (ids within the vocabulary, values finite or -inf), and with `draft` a first draft
        (`topk_p` > 0) within the vocabulary with a finite hidden state."""
        t = self._tensors
        first = int(t["output_ids"][slot, 0])
        if not 0 <= first < vocab_size:
            return f"metadata first_token_id = {first}, expected 0..{vocab_size - 1} (the vocabulary)"
        cached = int(t["cached_tokens"][slot, 0])
        if not 0 <= cached <= prompt_len:
            return f"metadata cached_tokens = {cached}, expected 0..{prompt_len} (the prompt's length)"
        values = []
        if logprob:
            values.append(("logprob_val", float(t["logprob_val"][slot, 0])))
        k = min(top_k, self.max_top_logprobs)
        for i, (v, idx) in enumerate(zip(t["top_logprobs_val"][slot, :k].tolist(),
                                         t["top_logprobs_idx"][slot, :k].tolist(), strict=True)):
            if not 0 <= idx < vocab_size:
                return (f"metadata top_logprobs_idx[{i}] = {idx}, expected 0..{vocab_size - 1} "
                        "(the vocabulary)")
            values.append((f"top_logprobs_val[{i}]", v))
        for name, v in values:
            if math.isnan(v) or v == math.inf:
                return f"metadata {name} = {v}, expected a finite logprob or -inf"
        if draft and float(t["topk_p"][slot, 0]) > 0:
            d = int(t["topk_index"][slot, 0])
            if not 0 <= d < vocab_size:
                return f"metadata topk_index[0] = {d}, expected 0..{vocab_size - 1} (the vocabulary)"
            if not bool(torch.isfinite(t["hidden_states"][slot, : self.hidden_size]).all()):
                return "metadata hidden_states has a value that is not finite"
        return None


class MetadataAllocator:
    """Free list of metadata slots (thread safe). `alloc()` returns None when all slots are taken."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def alloc(self) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._used.add(slot)
            return slot

    def free(self, slot: int) -> None:
        with self._lock:
            if slot not in self._used:
                raise ValueError(f"metadata slot {slot} is not allocated")
            self._used.remove(slot)
            self._free.append(slot)

    def available(self) -> int:
        with self._lock:
            return len(self._free)
