"""Torch attention backend over the paged KV pool (CPU reference path, fp32).

Call `init_forward_metadata(fb)` once per batch (the Llama model's forward does it when
`fb.attn_metadata` is None); it builds every gather index and mask the layers need, so each layer
only writes its new K/V and runs one gather + one SDPA (decode), or one per request (extend).

KV buffers are `[num_pages, kv_heads, page_size, head_dim]`; viewed flat as
`[num_pages * kv_heads * page_size, head_dim]`, token slot `s` of head `h` is row
`((s // page_size) * kv_heads + h) * page_size + s % page_size`. A gather with `[B, kv_heads, L]`
such rows yields K directly in the `[B, kv_heads, L, head_dim]` layout attention wants.

GQA: query head `h` uses KV head `h // group`. Decode reshapes queries to `[kv_heads, group, ...]`;
extend uses SDPA with `enable_gqa=True` (same grouping), so K/V are never repeated.

New tokens' K/V are written with one `index_copy_` per buffer on flat rows computed once per batch
(`write_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _ExtendItem:
    start: int  # first row of this request's new tokens in the batch
    n: int  # new tokens
    prefix: int  # cached tokens before them
    kv_index: torch.Tensor | None  # [kv_heads * (prefix + n)] flat rows, None when prefix == 0
    mask: torch.Tensor | None  # [n, prefix + n] bool (True = attend), only with a prefix and n > 1
    causal: bool  # no prefix and n > 1: plain causal attention over the new tokens


@dataclass
class TorchAttentionMetadata:
    mode: ForwardMode
    write_rows: torch.Tensor | None = None  # [T * kv_heads] flat rows of the new tokens' K/V
    # decode
    kv_index: torch.Tensor | None = None  # [B * kv_heads * Lmax] flat rows
    max_len: int = 0
    mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] additive (0 / -inf), None when all have Lmax tokens
    # extend
    items: list[_ExtendItem] = field(default_factory=list)


class TorchAttentionBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5 if scaling is None else scaling
        self._head_offsets = torch.arange(num_kv_heads, dtype=torch.int64)

    # ------------------------------------------------------------------ metadata
    def _flat_rows(self, slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """Flat buffer rows of `slots` `[..., L]` for every KV head: `[..., kv_heads, L]`."""
        pages = (slots // page_size).unsqueeze(-2)
        offs = (slots % page_size).unsqueeze(-2)
        heads = self._head_offsets.view(-1, 1)
        return (pages * self.num_kv_heads + heads) * page_size + offs

    def init_forward_metadata(self, fb: ForwardBatch) -> TorchAttentionMetadata:
        ps = fb.kv_pool.page_size
        write_rows = fb.kv_pool.flat_rows(fb.out_cache_loc) if hasattr(fb.kv_pool, "flat_rows") else None
        if fb.mode == ForwardMode.DECODE:
            lens = torch.tensor(fb.seq_lens, dtype=torch.int64)
            lmax = int(max(fb.seq_lens))
            slots = fb.req_to_token[fb.req_pool_indices, :lmax]
            md = TorchAttentionMetadata(mode=fb.mode, max_len=lmax)
            if int(lens.min()) < lmax:
                valid = torch.arange(lmax, dtype=torch.int64).unsqueeze(0) < lens.unsqueeze(1)
                slots = slots.masked_fill(~valid, 0)  # padding slot
                bias = torch.zeros(valid.shape, dtype=fb.kv_pool.dtype).masked_fill_(~valid, float("-inf"))
                md.mask = bias.view(len(fb.seq_lens), 1, 1, lmax)
            md.kv_index = self._flat_rows(slots, ps).reshape(-1)
        else:
            md = TorchAttentionMetadata(mode=fb.mode)
            start = 0
            rows = fb.req_pool_indices.tolist()
            for row, n, p in zip(rows, fb.extend_seq_lens, fb.extend_prefix_lens, strict=True):
                s = p + n
                kv_index = mask = None
                if p > 0:
                    kv_index = self._flat_rows(fb.req_to_token[row, :s], ps).reshape(-1)
                    if n > 1:
                        q_pos = torch.arange(p, s, dtype=torch.int64).unsqueeze(1)
                        mask = torch.arange(s, dtype=torch.int64).unsqueeze(0) <= q_pos
                md.items.append(_ExtendItem(start, n, p, kv_index, mask, causal=p == 0 and n > 1))
                start += n
        md.write_rows = write_rows
        fb.attn_metadata = md
        return md

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q `[T, heads * D]`, k/v `[T, kv_heads * D]` (new tokens) → `[T, heads * D]`."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        t = q.shape[0]
        k = k.view(t, hkv, d)
        v = v.view(t, hkv, d)
        pool = fb.kv_pool
        md: TorchAttentionMetadata = fb.attn_metadata
        if md.write_rows is None:
            pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        else:
            pool.set_kv_rows(layer_id, md.write_rows, k, v)
        if md.mode == ForwardMode.DECODE:
            k_flat = pool.k(layer_id).view(-1, d)
            v_flat = pool.v(layer_id).view(-1, d)
            b = t
            keys = k_flat.index_select(0, md.kv_index).view(b, hkv, md.max_len, d)
            values = v_flat.index_select(0, md.kv_index).view(b, hkv, md.max_len, d)
            # plain matmuls: torch's CPU flash kernel is slow for a handful of query rows
            scores = torch.matmul(q.view(b, hkv, g, d), keys.transpose(-1, -2))
            if md.mask is None:
                scores = scores.mul_(self.scaling)
            else:
                scores = torch.add(md.mask, scores, alpha=self.scaling)
            out = torch.matmul(scores.softmax(-1), values)
            return out.view(b, hkv * g * d)

        h = hkv * g
        out = torch.empty(t, h * d, dtype=q.dtype)
        k_flat = v_flat = None
        for it in md.items:
            n = it.n
            # [1, heads, n, D] / [1, kv_heads, s, D] views; SDPA's CPU flash kernel takes strides
            qi = q[it.start:it.start + n].view(n, h, d).transpose(0, 1).unsqueeze(0)
            if it.kv_index is None:
                ki = k[it.start:it.start + n].transpose(0, 1).unsqueeze(0)
                vi = v[it.start:it.start + n].transpose(0, 1).unsqueeze(0)
            else:
                if k_flat is None:
                    k_flat = pool.k(layer_id).view(-1, d)
                    v_flat = pool.v(layer_id).view(-1, d)
                s = it.prefix + n
                ki = k_flat.index_select(0, it.kv_index).view(1, hkv, s, d)
                vi = v_flat.index_select(0, it.kv_index).view(1, hkv, s, d)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=it.mask, is_causal=it.causal,
                                                scale=self.scaling, enable_gqa=g > 1)
            # [1, heads, n, D] -> [n, heads * D]
            out[it.start:it.start + n] = oi[0].transpose(0, 1).reshape(n, h * d)
        return out
