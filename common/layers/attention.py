"""Torch attention backends over the paged KV pool: `native` (the CPU's C kernels) and `torch_native`.

One class serves both names (`common/layers/attention_backend.py` chooses): with `native=True` (CPU,
float32 pools) decode and prefill run the C kernels described below where they apply; with
`native=False` every batch takes the torch paths, which run on any device (every tensor is made on
the pool's device): the reference the Triton and FlashInfer backends are checked against.

Call `init_forward_metadata(fb)` once per batch (the Llama model's forward does it when
`fb.attn_metadata` is None); it builds every gather index and mask the layers need, so each layer
only writes its new K/V and runs one gather + one SDPA (decode), or one per request (extend).

The KV pool (`common/memory/kv_pool.py`) is read and written through its flat `[rows, head_dim]`
view: metadata holds the rows of the first layer's K for every token and KV head, `[B, kv_heads, L]`
for decode, so one gather per layer (rows + the layer's offset, K and V together) yields K and V
directly in the `[B, kv_heads, L, head_dim]` layout attention wants.

Decode runs the native kernel (`paged_attention.c` via `common/layers/native.py`) when it could be
built: it reads each request's K and V rows in place, without the gather copy, one (request, KV
head) per OpenMP task. A speculative verify step runs it too, each new token a query of its own over
its request's tokens up to itself (the kernel stores every new K/V before it reads any). Extend runs
`prefill_attention.c` per request (float32, head size a multiple of its block), over the new tokens'
K/V in place or its prefix's and theirs gathered from the pool. Otherwise the torch paths below run
(one SDPA per request for extend).

GQA: query head `h` uses KV head `h // group`. Decode reshapes queries to `[kv_heads, group, ...]`;
the extend kernel reads KV head `h // group` for query head `h`, and its SDPA fallback runs with
`enable_gqa=True` (same grouping), so K/V are never repeated.

New tokens' K/V are written with one `index_copy_` per buffer on flat rows computed once per batch
(`write_rows`); the native decode kernel stores them itself, just before it reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.attention_backend import AttentionBackend
from common.layers.native import cpu_tensors, kv_store, paged_decode_attention, prefill_attention

# the decode kernel's limits (paged_attention.c's MAX_D, MAX_G): wider heads or groups take the torch path,
# e.g. latent attention's single KV head of 576 features shared by 128 query heads
NATIVE_DECODE_MAX_HEAD_DIM = 512
NATIVE_DECODE_MAX_GROUP = 64


@dataclass
class _ExtendItem:
    start: int  # first row of this request's new tokens in the batch
    n: int  # new tokens
    prefix: int  # cached tokens before them
    kv_index: torch.Tensor | None  # [2 * kv_heads * (prefix + n)] flat K then V rows, None when prefix == 0
    mask: torch.Tensor | None  # [n, prefix + n] bool (True = attend), only with a prefix and n > 1
    causal: bool  # no prefix and n > 1: plain causal attention over the new tokens


@dataclass
class TorchAttentionMetadata:
    mode: ForwardMode
    write_rows: torch.Tensor | None = None  # [T * kv_heads] flat rows of the new tokens (first layer's K)
    # decode
    kv_index: torch.Tensor | None = None  # [2 * B * kv_heads * Lmax] flat rows: K, then V (first layer)
    rows: torch.Tensor | None = None  # [B, kv_heads, Lmax] first layer's K rows, for the native kernel
    lens: torch.Tensor | None = None  # [B] tokens each request attends to (native kernel)
    max_len: int = 0
    mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] additive (0 / -inf), None when all have Lmax tokens
    # extend
    items: list[_ExtendItem] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    applies_window = False  # every key is attended; `SlidingWindowAttentionBackend` masks windows

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None, *,
                 native: bool = True, window: int | None = None, window_layers=(),
                 device: torch.device | str = "cpu") -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scaling, window=window,
                         window_layers=window_layers, device=device)
        if self.window_layers and not self.applies_window:
            raise ValueError("TorchAttentionBackend attends to every key: a sliding window needs "
                             "SlidingWindowAttentionBackend (create_attention_backend chooses it)")
        native = native and self.device.type == "cpu"
        self.name = "native" if native else "torch_native"
        fits = head_dim <= NATIVE_DECODE_MAX_HEAD_DIM and self.group <= NATIVE_DECODE_MAX_GROUP
        self.native = paged_decode_attention() if native and fits else None
        self.native_store = kv_store() if native else None
        native_prefill = prefill_attention() if native else None
        self.native_prefill = native_prefill[0] \
            if native_prefill and head_dim % native_prefill[1] == 0 else None

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> TorchAttentionMetadata:
        pool = fb.kv_pool
        dev = pool.data.device
        write_rows = pool.flat_rows(fb.out_cache_loc)
        verify_native = fb.mode == ForwardMode.VERIFY and self.native is not None \
            and pool.dtype == torch.float32
        if fb.mode == ForwardMode.DECODE or verify_native:
            lmax = int(max(fb.seq_lens))
            if fb.mode == ForwardMode.VERIFY:
                # each new token is a query of its own over its request's tokens up to itself
                lens = fb.positions + 1
                req_rows = torch.repeat_interleave(fb.req_pool_indices,
                                                   torch.tensor(fb.extend_seq_lens, device=dev))
            else:
                lens = torch.tensor(fb.seq_lens, dtype=torch.int64, device=dev)
                req_rows = fb.req_pool_indices
            slots = fb.req_to_token[req_rows, :lmax]
            md = TorchAttentionMetadata(mode=fb.mode, max_len=lmax)
            if self.native is not None and pool.dtype == torch.float32:
                md.rows = pool.token_rows(slots).contiguous()  # rows past a request's length are not read
                md.lens = lens
            else:
                if int(lens.min()) < lmax:
                    valid = torch.arange(lmax, dtype=torch.int64, device=dev).unsqueeze(0) < lens.unsqueeze(1)
                    slots = slots.masked_fill(~valid, 0)  # padding slot
                    bias = torch.zeros(valid.shape, dtype=pool.dtype,
                                       device=dev).masked_fill_(~valid, float("-inf"))
                    md.mask = bias.view(len(fb.seq_lens), 1, 1, lmax)
                md.kv_index = pool.kv_rows(pool.token_rows(slots).reshape(-1))
        else:
            md = TorchAttentionMetadata(mode=fb.mode)
            start = 0
            rows = fb.req_pool_indices.tolist()
            for row, n, p in zip(rows, fb.extend_seq_lens, fb.extend_prefix_lens, strict=True):
                s = p + n
                kv_index = mask = None
                if p > 0:
                    kv_index = pool.kv_rows(pool.token_rows(fb.req_to_token[row, :s]).reshape(-1))
                    if n > 1:
                        q_pos = torch.arange(p, s, dtype=torch.int64, device=dev).unsqueeze(1)
                        mask = torch.arange(s, dtype=torch.int64, device=dev).unsqueeze(0) <= q_pos
                md.items.append(_ExtendItem(start, n, p, kv_index, mask, causal=p == 0 and n > 1))
                start += n
        md.write_rows = write_rows
        fb.attn_metadata = md
        return md

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        """q `[T, heads * D]`, k/v `[T, kv_heads * D]` (new tokens) → `[T, heads * D]`."""
        md: TorchAttentionMetadata = fb.attn_metadata
        if md.rows is not None:  # the native kernel: decode, or a verify step's tokens as decode queries
            t, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
            return self._native_decode(q, k.view(t, hkv, d), v.view(t, hkv, d), layer_id, fb.kv_pool, md)
        if md.mode == ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer_id, fb)
        return self.forward_extend(q, k, v, layer_id, fb)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        t = q.shape[0]
        pool = fb.kv_pool
        md: TorchAttentionMetadata = fb.attn_metadata
        pool.set_kv_rows(layer_id, md.write_rows, k.view(t, hkv, d), v.view(t, hkv, d))
        keys, values = pool.gather_kv(layer_id, md.kv_index)
        keys = keys.view(t, hkv, md.max_len, d)
        values = values.view(t, hkv, md.max_len, d)
        out_dtype = q.dtype
        q = q.to(pool.dtype)  # computed in the cache's dtype (a no-op unless --kv-cache-dtype differs)
        # plain matmuls: torch's CPU flash kernel is slow for a handful of query rows
        scores = torch.matmul(q.view(t, hkv, g, d), keys.transpose(-1, -2))
        if md.mask is None:
            scores = scores.mul_(self.scaling)
        else:
            scores = torch.add(md.mask, scores, alpha=self.scaling)
        out = torch.matmul(scores.softmax(-1), values)
        return out.view(t, hkv * g * d).to(out_dtype)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        t = q.shape[0]
        k = k.view(t, hkv, d)
        v = v.view(t, hkv, d)
        pool = fb.kv_pool
        md: TorchAttentionMetadata = fb.attn_metadata
        self._store_kv(pool, layer_id, md.write_rows, k, v)
        h = hkv * g
        out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
        native = self.native_prefill is not None and q.dtype == torch.float32 and q.stride(1) == 1
        for it in md.items:
            n = it.n
            if native:
                self._native_extend(q, k, v, layer_id, pool, it, out)
                continue
            # [1, heads, n, D] / [1, kv_heads, s, D] views; SDPA's CPU flash kernel takes strides
            qi = q[it.start:it.start + n].view(n, h, d).transpose(0, 1).unsqueeze(0)
            if it.kv_index is None:
                ki = k[it.start:it.start + n].transpose(0, 1).unsqueeze(0)
                vi = v[it.start:it.start + n].transpose(0, 1).unsqueeze(0)
            else:
                s = it.prefix + n
                ki, vi = pool.gather_kv(layer_id, it.kv_index)
                ki = ki.view(1, hkv, s, d).to(q.dtype)
                vi = vi.view(1, hkv, s, d).to(q.dtype)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=it.mask, is_causal=it.causal,
                                                scale=self.scaling, enable_gqa=g > 1)
            # [1, heads, n, D] -> [n, heads * D]
            out[it.start:it.start + n] = oi[0].transpose(0, 1).reshape(n, h * d)
        return out

    def _store_kv(self, pool, layer_id: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K and V (`[t, kv_heads, D]`) into the pool: `kv_store.c` on every thread for a
        float32 pool (reading the projection's strided views in place), else `set_kv_rows`."""
        d = self.head_dim
        if (self.native_store is None or pool.flat.dtype != torch.float32
                or not cpu_tensors(pool.flat, k, v, rows)
                or k.dtype != torch.float32 or v.dtype != torch.float32 or rows.dtype != torch.int64
                or k.stride()[1:] != (d, 1) or v.stride()[1:] != (d, 1) or not rows.is_contiguous()):
            pool.set_kv_rows(layer_id, rows, k, v)
            return
        self.native_store(pool.flat.data_ptr(), rows.data_ptr(), k.shape[0], k.shape[1], d,
                          pool.layer_offset(layer_id), pool.v_offset, k.data_ptr(), k.stride(0),
                          v.data_ptr(), v.stride(0))

    def _native_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool,
                       it: _ExtendItem, out: torch.Tensor) -> None:
        """One request's causal attention (`prefill_attention.c`): its new tokens' K/V read in place, or
        its prefix's and theirs gathered from the pool (`[kv_heads, prefix + n, D]`)."""
        d = self.head_dim
        if it.kv_index is None:
            ki, vi = k[it.start:it.start + it.n], v[it.start:it.start + it.n]
            if ki.stride(2) != 1 or vi.stride(2) != 1 or ki.stride(1) != vi.stride(1) \
                    or ki.dtype != torch.float32:
                ki, vi = ki.to(torch.float32).contiguous(), vi.to(torch.float32).contiguous()
            k_tok, v_tok, kv_head = ki.stride(0), vi.stride(0), ki.stride(1)
        else:
            ki, vi = (t.to(torch.float32) for t in pool.gather_kv(layer_id, it.kv_index))
            k_tok, v_tok, kv_head = d, d, (it.prefix + it.n) * d
        qi, oi = q[it.start:], out[it.start:]
        rc = self.native_prefill(qi.data_ptr(), q.stride(0), ki.data_ptr(), k_tok, vi.data_ptr(), v_tok,
                                 kv_head, it.n, it.prefix, self.num_heads, self.group, d, self.scaling,
                                 oi.data_ptr(), out.stride(0))
        if rc != 0:
            raise MemoryError(f"native prefill attention: no memory for {it.prefix + it.n} keys")

    def _native_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, pool,
                       md: TorchAttentionMetadata) -> torch.Tensor:
        """The kernel also writes this step's K/V (`[B, kv_heads, D]` views) into the pool."""
        b = q.shape[0]
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        if q.stride(1) != 1:
            q = q.contiguous()
        if k.stride()[1:] != (d, 1) or k.dtype != torch.float32:
            k = k.to(torch.float32).contiguous()
        if v.stride()[1:] != (d, 1) or v.dtype != torch.float32:
            v = v.to(torch.float32).contiguous()
        out = torch.empty(b, hkv * g * d, dtype=q.dtype)
        rc = self.native(q.data_ptr(), q.stride(0), pool.flat.data_ptr(),
                         md.rows.data_ptr(), md.lens.data_ptr(),
                         b, hkv, g, d, md.max_len, pool.layer_offset(layer_id), pool.v_offset, self.scaling,
                         out.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                         md.write_rows.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native paged attention failed (group {g}, head_dim {d})")
        return out
