"""The `triton` attention backend: the kernels of `common/layers/triton_kernels.py` over the paged pool.

Per batch `init_forward_metadata(fb)` puts what the kernels read into tensors on the pool's device
(`TritonMetadata`), once for all layers:

* decode: each request's `req_to_token` row and length, and the float32 scratch of the split-KV
  partial results (`[B, heads, splits, head_dim]` and `[B, heads, splits]`). The split count is
  the backend's `num_kv_splits`, fixed, so the kernel grids depend on the batch size only;
* extend and verify (both attended as an extend: new tokens on top of a cached prefix, causal):
  per request its first row in the batch, its new and its cached token counts and its table row,
  and per query block of `extend_block_m` new tokens its request and first token, so one launch per
  layer covers the whole batch.

Each layer first stores its new tokens' K/V at `fb.out_cache_loc` (a small kernel; the pool may hold
another dtype than q, cast on store and cast back on load) and then runs decode or extend; a layer in
`window_layers` attends only to the last `window` keys of each query.

CUDA graphs (decode only): `init_cuda_graph_state(max_bs, ...)` allocates the decode metadata once,
`max_bs` rows. `init_forward_metadata_capture` / `_replay` copy a decode batch's table rows, lengths
and slots into the first rows of those buffers and pad the rest (length 1, slot 0: the padding
page), then point `fb.attn_metadata` at views of them; the captured kernels read the buffers, so a
replay sees the new batch. These copies run before the replay, outside the captured region.

Block sizes and warps: on CUDA, 64 x 64 tiles up to head size 128 (8 warps and 32-key blocks above);
on CPU tensors (the Triton interpreter, for tests) 16 x 16, the least `tl.dot` takes, and fewer
splits, so small test batches still cross block and split boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.attention_backend import AttentionBackend
from common.layers.triton_kernels import decode_attention, extend_attention, interpreted, store_kv


@dataclass
class TritonMetadata:
    mode: ForwardMode
    out_cache_loc: torch.Tensor  # [T] slots of the new tokens
    req_rows: torch.Tensor  # [B] int64 rows of req_to_token
    # decode
    seq_lens: torch.Tensor | None = None  # [B] int32 tokens per request, this step's included
    mid_o: torch.Tensor | None = None  # [B, heads, splits, head_dim] float32
    mid_lse: torch.Tensor | None = None  # [B, heads, splits] float32
    # extend / verify
    q_start: torch.Tensor | None = None  # [B] int32 first row of each request's new tokens
    ext_lens: torch.Tensor | None = None  # [B] int32 new tokens
    prefix_lens: torch.Tensor | None = None  # [B] int32 cached tokens before them
    block_req: torch.Tensor | None = None  # [blocks] int32 request of each query block
    block_m: torch.Tensor | None = None  # [blocks] int32 its first new token


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None, *,
                 window: int | None = None, window_layers=(), device: torch.device | str = "cpu") -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scaling, window=window,
                         window_layers=window_layers, device=device)
        if self.device.type == "cuda":
            self.num_kv_splits = 16
            self.decode_block_n = 64 if head_dim <= 128 else 32
            self.extend_block_m = 64
            self.extend_block_n = 64 if head_dim <= 128 else 32
            self.num_warps = 4 if head_dim <= 128 else 8
        else:
            _require_interpreter(self.device)
            self.num_kv_splits = 4
            self.decode_block_n = self.extend_block_m = self.extend_block_n = 16
            self.num_warps = 4
        self._graph: TritonMetadata | None = None
        self._graph_max_bs = 0

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> TritonMetadata:
        dev = fb.kv_pool.flat.device
        loc = fb.out_cache_loc.to(dev)
        rows = fb.req_pool_indices.to(device=dev, dtype=torch.int64)
        if fb.mode == ForwardMode.DECODE:
            b = len(fb.seq_lens)
            md = TritonMetadata(
                fb.mode, loc, rows, seq_lens=torch.tensor(fb.seq_lens, dtype=torch.int32, device=dev),
                mid_o=torch.empty(b, self.num_heads, self.num_kv_splits, self.head_dim, dtype=torch.float32,
                                  device=dev),
                mid_lse=torch.empty(b, self.num_heads, self.num_kv_splits, dtype=torch.float32, device=dev))
        else:
            bm = self.extend_block_m
            starts, block_req, block_m = [], [], []
            start = 0
            for r, n in enumerate(fb.extend_seq_lens):
                starts.append(start)
                for m0 in range(0, n, bm):
                    block_req.append(r)
                    block_m.append(m0)
                start += n

            def i32(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int32, device=dev)

            md = TritonMetadata(fb.mode, loc, rows, q_start=i32(starts),
                                ext_lens=i32(list(fb.extend_seq_lens)),
                                prefix_lens=i32(list(fb.extend_prefix_lens)), block_req=i32(block_req),
                                block_m=i32(block_m))
        fb.attn_metadata = md
        return md

    # ------------------------------------------------------------------ forward
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        md: TritonMetadata = fb.attn_metadata
        pool = fb.kv_pool
        if md.seq_lens.shape[0] != q.shape[0]:
            raise ValueError(f"decode metadata for {md.seq_lens.shape[0]} requests, {q.shape[0]} queries")
        store_kv(pool, layer_id, k, v, md.out_cache_loc)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        decode_attention(q, out, pool, layer_id, fb.req_to_token, md.req_rows,
                         md.seq_lens, md.mid_o, md.mid_lse,
                         num_heads=self.num_heads, scaling=self.scaling, window=self.layer_window(layer_id),
                         block_n=self.decode_block_n, num_warps=self.num_warps)
        return out

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        md: TritonMetadata = fb.attn_metadata
        pool = fb.kv_pool
        store_kv(pool, layer_id, k, v, md.out_cache_loc)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        extend_attention(q, k, v, out, pool, layer_id, fb.req_to_token, md.req_rows, md.q_start, md.ext_lens,
                         md.prefix_lens, md.block_req, md.block_m,
                         num_heads=self.num_heads, scaling=self.scaling,
                         window=self.layer_window(layer_id), block_size_m=self.extend_block_m,
                         block_n=self.extend_block_n, num_warps=self.num_warps)
        return out

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        dev, h, s = self.device, self.num_heads, self.num_kv_splits
        self._graph_max_bs = max_bs
        self._graph = TritonMetadata(
            ForwardMode.DECODE,
            out_cache_loc=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            req_rows=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            mid_o=torch.zeros(max_bs, h, s, self.head_dim, dtype=torch.float32, device=dev),
            mid_lse=torch.zeros(max_bs, h, s, dtype=torch.float32, device=dev))

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        self._graph_metadata(fb)

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        self._graph_metadata(fb)

    def _graph_metadata(self, fb: ForwardBatch) -> None:
        """Copy a decode batch into the graph buffers (the rows after it padded) and point
        `fb.attn_metadata` at views of its rows."""
        g = self._graph
        if g is None:
            raise RuntimeError("init_cuda_graph_state must run before a CUDA graph is captured or replayed")
        if fb.mode != ForwardMode.DECODE:
            raise ValueError(f"CUDA graphs run decode batches only, not {fb.mode.name}")
        n = len(fb.seq_lens)
        if n > self._graph_max_bs:
            raise ValueError(f"a decode batch of {n} exceeds the graphs' {self._graph_max_bs} rows")
        g.req_rows[:n].copy_(fb.req_pool_indices, non_blocking=True)
        g.req_rows[n:].zero_()
        g.seq_lens[:n].copy_(torch.tensor(fb.seq_lens, dtype=torch.int32), non_blocking=True)
        g.seq_lens[n:].fill_(1)
        g.out_cache_loc[:n].copy_(fb.out_cache_loc, non_blocking=True)
        g.out_cache_loc[n:].zero_()
        fb.attn_metadata = TritonMetadata(ForwardMode.DECODE, g.out_cache_loc[:n], g.req_rows[:n],
                                          seq_lens=g.seq_lens[:n], mid_o=g.mid_o[:n], mid_lse=g.mid_lse[:n])


def _require_interpreter(device: torch.device) -> None:
    """Triton runs on CPU tensors only in its interpreter, chosen when triton is first imported."""
    if not interpreted():
        raise ValueError(f"the triton attention backend on {device.type} tensors needs TRITON_INTERPRET=1 in "
                         "the environment before triton is imported (its interpreter); on a GPU use "
                         "--device cuda")
