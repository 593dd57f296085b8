"""Sliding-window attention over the paged KV pool: `TorchAttentionBackend` for the layers that see
every earlier token, a window mask for the layers that see only the last `window` tokens (torch ops on
the pool's device: the `native` and `torch_native` backends of a windowed model).

A query at position i attends to keys j with `i - window < j <= i` (Hugging Face's sliding-window
mask: the window counts the query's own token). Windowed layers gather only the keys inside the
window, so tokens older than every live query's window are never read: a decode gathers
`min(window, seq_len)` keys per request, an extend the keys from `prefix - window + 1` on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.attention import TorchAttentionBackend


@dataclass
class _WindowItem:
    start: int  # first row of this request's new tokens in the batch
    n: int  # new tokens
    keys: int  # keys this request's queries look at (window part of the prefix + the new tokens)
    kv_index: torch.Tensor | None  # [kv_heads * keys] flat rows; None: the keys are the new tokens
    bias: torch.Tensor | None  # [group * n, keys] additive mask (0 / -inf); None: every key is visible


@dataclass
class WindowMetadata:
    mode: ForwardMode
    kv_index: torch.Tensor | None = None  # decode: [B * kv_heads * width] flat rows
    width: int = 0
    bias: torch.Tensor | None = None  # decode: [B, 1, 1, width] additive, None when all keys are valid
    items: list[_WindowItem] = field(default_factory=list)


@dataclass
class SlidingWindowMetadata:
    full: object | None  # the base backend's metadata, built when the batch's first full layer runs
    window: WindowMetadata


def window_start(seq_len: int, window: int) -> int:
    """First token position that a query at position `seq_len - 1` still sees."""
    return max(0, seq_len - window)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype,
                       device=allowed.device).masked_fill_(~allowed, float("-inf"))


class SlidingWindowAttentionBackend(TorchAttentionBackend):
    applies_window = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None, *,
                 window: int, window_layers, native: bool = True, device: torch.device | str = "cpu") -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scaling, native=native, window=window,
                         window_layers=window_layers, device=device)
        if not self.window_layers:
            raise ValueError("a sliding-window backend needs the layers that use the window")

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> SlidingWindowMetadata:
        md = SlidingWindowMetadata(full=None, window=self._window_metadata(fb))
        fb.attn_metadata = md
        return md

    def _window_metadata(self, fb: ForwardBatch) -> WindowMetadata:
        pool = fb.kv_pool
        w = self.window
        dtype = fb.kv_pool.dtype
        dev = pool.data.device
        if fb.mode == ForwardMode.DECODE:
            lens = torch.tensor(fb.seq_lens, dtype=torch.int64, device=dev)
            width = min(w, max(fb.seq_lens))
            starts = (lens - w).clamp(min=0)
            cols = starts.unsqueeze(1) + torch.arange(width, dtype=torch.int64, device=dev).unsqueeze(0)
            valid = cols < lens.unsqueeze(1)
            cols = cols.masked_fill(~valid, 0)
            slots = fb.req_to_token[fb.req_pool_indices.unsqueeze(1), cols].masked_fill(~valid, 0)
            md = WindowMetadata(mode=fb.mode, width=width)
            if not bool(valid.all()):
                md.bias = _additive(valid, dtype).view(len(fb.seq_lens), 1, 1, width)
            md.kv_index = pool.kv_rows(pool.token_rows(slots).reshape(-1))
            return md
        md = WindowMetadata(mode=fb.mode)
        start = 0
        g = self.group
        for row, n, p in zip(fb.req_pool_indices.tolist(), fb.extend_seq_lens, fb.extend_prefix_lens,
                             strict=True):
            s = p + n
            lo = max(0, p - w + 1)  # oldest key that the first new query sees
            kv_index = bias = None
            if p > 0:
                kv_index = pool.kv_rows(pool.token_rows(fb.req_to_token[row, lo:s]).reshape(-1))
            q_pos = torch.arange(p, s, dtype=torch.int64, device=dev).repeat(g).unsqueeze(1)
            k_pos = torch.arange(lo, s, dtype=torch.int64, device=dev).unsqueeze(0)
            allowed = (k_pos <= q_pos) & (k_pos > q_pos - w)
            if not bool(allowed.all()):
                bias = _additive(allowed, dtype)
            md.items.append(_WindowItem(start, n, s - lo, kv_index, bias))
            start += n
        return md

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        md: SlidingWindowMetadata = fb.attn_metadata
        if layer_id not in self.window_layers:
            if md.full is None:
                md.full = super().init_forward_metadata(fb)
            fb.attn_metadata = md.full
            try:
                return super().forward(q, k, v, layer_id, fb)
            finally:
                fb.attn_metadata = md
        return self._window_forward(q, k, v, layer_id, fb, md.window)

    def _window_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                        fb: ForwardBatch, md: WindowMetadata) -> torch.Tensor:
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        t = q.shape[0]
        k = k.view(t, hkv, d)
        v = v.view(t, hkv, d)
        pool = fb.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        if md.mode == ForwardMode.DECODE:
            keys, values = pool.gather_kv(layer_id, md.kv_index)
            keys = keys.view(t, hkv, md.width, d).to(q.dtype)
            values = values.view(t, hkv, md.width, d).to(q.dtype)
            scores = torch.matmul(q.view(t, hkv, g, d), keys.transpose(-1, -2)) * self.scaling
            if md.bias is not None:
                scores = scores + md.bias
            return torch.matmul(scores.softmax(-1), values).reshape(t, hkv * g * d)
        out = torch.empty(t, hkv * g * d, dtype=q.dtype, device=q.device)
        for it in md.items:
            n = it.n
            qi = q[it.start:it.start + n].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            if it.kv_index is None:
                ki = k[it.start:it.start + n].transpose(0, 1)
                vi = v[it.start:it.start + n].transpose(0, 1)
            else:
                ki, vi = pool.gather_kv(layer_id, it.kv_index)
                ki = ki.view(hkv, it.keys, d).to(q.dtype)
                vi = vi.view(hkv, it.keys, d).to(q.dtype)
            scores = torch.bmm(qi, ki.transpose(1, 2)) * self.scaling
            if it.bias is not None:
                scores = scores + it.bias
            oi = torch.bmm(scores.softmax(-1), vi)
            out[it.start:it.start + n] = oi.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g * d)
        return out
