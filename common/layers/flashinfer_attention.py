"""The `flashinfer` attention backend: FlashInfer's paged-KV wrappers over our own KV pool (CUDA only,
with the optional `flashinfer-python` package: `pip install 'pdserve[gpu]'`).

The pool is read in place. A layer's `pool.k(layer_id)` / `pool.v(layer_id)` are `[num_pages, kv_heads,
page_size, head_dim]` views, FlashInfer's "HND" layout, whose pages are a whole pool page apart (every
layer's K and V of a page sit together, `common/memory/kv_pool.py`). FlashInfer takes a paged cache as a
`(k_cache, v_cache)` tuple and reads its strides from the tensors (its `paged_kv_t` is built from
`k_cache.strides()`; the decode kernel only asks that K and V have the same strides, which two layer
views of one pool do), so no copy or repacking is needed.

Per batch `init_forward_metadata(fb)` builds the page table FlashInfer wants (`paged_kv_layout`): per
request the pages of its `seq_lens` tokens, `req_to_token[row, ::page_size] // page_size`, as
`indptr` / `indices` / `last_page_len`. The wrappers are planned from it at most once per batch and
window: decode batches through `BatchDecodeWithPagedKVCacheWrapper`, extend and verify batches (new
tokens on top of a cached prefix) through `BatchPrefillWithPagedKVCacheWrapper` with `causal=True`,
whose mask is aligned to the end of each request's keys, so query i of n new tokens over s keys sees
keys up to s - n + i. The new tokens' K/V are written into the pool first (one `index_copy_` per
buffer at the rows of `pool.flat_rows(out_cache_loc)`), then attended with the rest of the pages.

Sliding window: FlashInfer's `window_left` is the number of earlier keys a query still sees, so our
window w (keys j with i - w < j <= i) is `window_left = w - 1`. Layers with and without a window get
wrappers of their own (the window is part of a plan); each is planned when the batch's first layer of
its kind runs, so a model whose layers are all windowed never plans a full-attention one.

Dtypes: FlashInfer's kernels take float16 / bfloat16 (and fp8) K/V, not float32: a float32 KV cache is
refused with the flags to change. q is cast to the KV cache's dtype when they differ, the output cast
back. GQA: the CUDA-core decode kernel is compiled for groups up to 8 (1, 2, 3, 4, 6, 8); groups above 4
run FlashInfer's tensor-core decode, which takes any group.

CUDA graphs (decode only, `common/cuda_graph.py`): in graph mode FlashInfer fixes a decode wrapper's
batch size and reads the page table from buffers given at construction. `init_cuda_graph_state` makes
those buffers once for `max_bs` rows (the page-index buffer is sized at the first capture, when the
pool's page size is known); each captured batch size gets its own wrappers over the first rows of the
buffers. `init_forward_metadata_capture` / `_replay` plan them (outside the graph: FlashInfer's plan
runs on the host) with the padded batch, which writes the page table into the buffers the captured
kernels read. In a captured forward the new tokens' rows are computed inside the graph from
`fb.out_cache_loc` (the graph runner's static buffer), since they change at every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.attention_backend import AttentionBackend

# FlashInfer's recommended float workspace (split-KV partial results), shared by every wrapper: they run
# one after the other on one stream
WORKSPACE_BYTES = 128 * 2**20
KV_DTYPES = (torch.float16, torch.bfloat16)
# the largest GQA group taken by the CUDA-core decode kernel here; larger groups use the tensor-core one
CUDA_CORE_DECODE_GROUP = 4


def import_flashinfer():
    """The `flashinfer` module, or a RuntimeError that names the flag and the package."""
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("--attention-backend flashinfer needs the flashinfer-python package "
                           "(pip install 'pdserve[gpu]')") from e
    return flashinfer


class PagedKV(NamedTuple):
    """A batch's page table in FlashInfer's form."""
    indptr: torch.Tensor  # [B + 1] int32, host: request b's pages are indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor  # [total pages] int32, on req_to_token's device
    last_page_len: torch.Tensor  # [B] int32, host: tokens in each request's last page (1..page_size)


def token_indptr(counts: list[int]) -> torch.Tensor:
    """`[len(counts) + 1]` int32 running sum from 0 (a host tensor: FlashInfer's plans read it there)."""
    out = torch.zeros(len(counts) + 1, dtype=torch.int32)
    if counts:
        out[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return out


def paged_kv_layout(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int],
                    page_size: int) -> PagedKV:
    """The pages of each request's first `seq_lens[b]` tokens, from its row `req_pool_indices[b]` of
    `req_to_token`. A request's token p lives at offset p % page_size of its page (the allocator hands
    out whole pages), so its pages are the slots at positions 0, page_size, 2 * page_size, ... divided by
    page_size. The counts come from the host list; one small host-to-device copy of (request, position)
    pairs and one gather on the device give the indices, with no device-to-host read."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    if lens.numel() and int(lens.min()) < 1:
        raise ValueError(f"every request of a batch attends to at least one token, got seq_lens {seq_lens}")
    pages = (lens + page_size - 1) // page_size
    indptr = token_indptr(pages.tolist())
    last_page_len = (lens - (pages - 1) * page_size).to(torch.int32)
    total = int(indptr[-1])
    req = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int64), pages)
    first = indptr[:-1].to(torch.int64).repeat_interleave(pages)
    pos = (torch.arange(total, dtype=torch.int64) - first) * page_size
    dev = req_to_token.device
    pairs = torch.stack([req, pos]).to(dev, non_blocking=True)
    rows = req_pool_indices.to(device=dev, dtype=torch.int64)[pairs[0]]
    indices = (req_to_token[rows, pairs[1]] // page_size).to(torch.int32)
    return PagedKV(indptr, indices, last_page_len)


@dataclass
class FlashInferMetadata:
    mode: ForwardMode
    dtype: torch.dtype  # the KV cache's, which the plans and q use
    page_size: int
    layout: PagedKV
    qo_indptr: torch.Tensor | None = None  # extend / verify: [B + 1] int32 host, each request's new tokens
    # [T * kv_heads] pool rows of the new tokens (first layer's K); None in a captured forward, where they
    # are computed in each layer from fb.out_cache_loc
    write_rows: torch.Tensor | None = None
    # a captured batch size's wrappers (window_left -> wrapper), planned before capture and each replay
    graph: dict[int, Any] | None = None
    graph_used: set[int] = field(default_factory=set)  # the windows its layers ran with (shared per size)


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None, *,
                 window: int | None = None, window_layers=(), device: torch.device | str = "cuda") -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scaling, window=window,
                         window_layers=window_layers, device=device)
        self.flashinfer = import_flashinfer()
        # window_left of every kind of layer: -1 (every earlier key), window - 1 on the windowed ones
        self.windows = [-1] + ([self.window - 1] if self.window is not None else [])
        self.use_tensor_cores = self.group > CUDA_CORE_DECODE_GROUP
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        fi = self.flashinfer
        self._decode = {wl: fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND",
                                                                  use_tensor_cores=self.use_tensor_cores)
                        for wl in self.windows}
        self._prefill = {wl: fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND")
                         for wl in self.windows}
        self._planned_for: dict[tuple[bool, int], FlashInferMetadata] = {}  # (decode?, window_left) -> batch
        # CUDA graphs
        self._graph_max_bs = 0
        self._graph_context = 0
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._graph_wrappers: dict[int, dict[int, Any]] = {}  # batch size -> window_left -> wrapper
        self._graph_used: dict[int, set[int]] = {}

    def window_left(self, layer_id: int) -> int:
        w = self.layer_window(layer_id)
        return -1 if w is None else w - 1

    @staticmethod
    def kv_dtype(pool) -> torch.dtype:
        if pool.dtype not in KV_DTYPES:
            raise ValueError(f"--attention-backend flashinfer needs a float16 or bfloat16 KV cache, not "
                             f"{str(pool.dtype).removeprefix('torch.')}: use --kv-cache-dtype bfloat16 (or "
                             "--dtype bfloat16), or --attention-backend triton for a float32 cache")
        return pool.dtype

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, fb: ForwardBatch) -> FlashInferMetadata:
        pool = fb.kv_pool
        md = FlashInferMetadata(mode=fb.mode, dtype=self.kv_dtype(pool), page_size=pool.page_size,
                                layout=paged_kv_layout(fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                                       pool.page_size),
                                write_rows=pool.flat_rows(fb.out_cache_loc))
        if fb.mode != ForwardMode.DECODE:
            md.qo_indptr = token_indptr(list(fb.extend_seq_lens))
        fb.attn_metadata = md
        return md

    def _plan_decode(self, wrapper, md: FlashInferMetadata, window_left: int) -> None:
        lay = md.layout
        wrapper.plan(lay.indptr, lay.indices, lay.last_page_len, self.num_heads,
                     self.num_kv_heads, self.head_dim,
                     md.page_size, window_left=window_left, q_data_type=md.dtype, kv_data_type=md.dtype,
                     sm_scale=self.scaling)

    def _plan_extend(self, wrapper, md: FlashInferMetadata, window_left: int) -> None:
        lay = md.layout
        wrapper.plan(md.qo_indptr, lay.indptr, lay.indices, lay.last_page_len,
                     self.num_heads, self.num_kv_heads,
                     self.head_dim, md.page_size, causal=True, sm_scale=self.scaling, window_left=window_left,
                     q_data_type=md.dtype, kv_data_type=md.dtype)

    def _wrapper(self, md: FlashInferMetadata, window_left: int):
        """The wrapper planned for this batch and window: planned now when this batch has not yet used it
        (another batch's plan may be in it)."""
        if md.graph is not None:
            md.graph_used.add(window_left)
            return md.graph[window_left]
        decode = md.mode == ForwardMode.DECODE
        wrapper = (self._decode if decode else self._prefill)[window_left]
        key = (decode, window_left)
        if self._planned_for.get(key) is not md:
            (self._plan_decode if decode else self._plan_extend)(wrapper, md, window_left)
            self._planned_for[key] = md
        return wrapper

    # ------------------------------------------------------------------ forward
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer_id, fb)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer_id, fb)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        md: FlashInferMetadata = fb.attn_metadata
        pool = fb.kv_pool
        t, h, hkv, d = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        rows = md.write_rows if md.write_rows is not None else pool.flat_rows(fb.out_cache_loc)
        pool.set_kv_rows(layer_id, rows, k.reshape(t, hkv, d), v.reshape(t, hkv, d))
        wrapper = self._wrapper(md, self.window_left(layer_id))
        qh = q.reshape(t, h, d)  # a view of a qkv slice: FlashInfer takes q's token and head strides
        if qh.dtype != md.dtype:
            qh = qh.to(md.dtype)
        out = wrapper.run(qh, (pool.k(layer_id), pool.v(layer_id)))
        return out.reshape(t, h * d).to(q.dtype)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self._graph_max_bs = max_bs
        self._graph_context = max_context_len
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_indices = None
        self._graph_wrappers = {}
        self._graph_used = {}

    def _check_graph_batch(self, fb: ForwardBatch) -> int:
        if self._graph_indptr is None:
            raise RuntimeError("init_cuda_graph_state must run before a CUDA graph is captured or replayed")
        if fb.mode != ForwardMode.DECODE:
            raise ValueError(f"CUDA graphs run decode batches only, not {fb.mode.name}")
        bs = fb.batch_size
        if bs > self._graph_max_bs:
            raise ValueError(f"a decode batch of {bs} exceeds the graphs' {self._graph_max_bs} rows")
        return bs

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        bs = self._check_graph_batch(fb)
        if self._graph_indices is None:
            pages = -(-self._graph_context // fb.kv_pool.page_size)
            self._graph_indices = torch.zeros(self._graph_max_bs * pages,
                                              dtype=torch.int32, device=self.device)
        fi = self.flashinfer
        self._graph_wrappers[bs] = {
            wl: fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._graph_indptr[:bs + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs])
            for wl in self.windows}
        self._graph_used[bs] = set()
        self._graph_metadata(fb, bs, self.windows)

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        bs = self._check_graph_batch(fb)
        if bs not in self._graph_wrappers:
            raise ValueError(f"no CUDA graph was captured for a decode batch of {bs}")
        # the windows the captured layers read (all of them if the capture ran no layer)
        self._graph_metadata(fb, bs, sorted(self._graph_used[bs]) or self.windows)

    def _graph_metadata(self, fb: ForwardBatch, bs: int, windows: list[int]) -> None:
        """Plan the batch size's wrappers with this (padded) batch: the page table goes into the graph
        buffers. The wrappers of one size share them (they hold the same table)."""
        pool = fb.kv_pool
        md = FlashInferMetadata(mode=ForwardMode.DECODE, dtype=self.kv_dtype(pool), page_size=pool.page_size,
                                layout=paged_kv_layout(fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                                       pool.page_size),
                                graph=self._graph_wrappers[bs], graph_used=self._graph_used[bs])
        if md.layout.indices.numel() > self._graph_indices.numel():
            raise ValueError(f"a decode batch of {md.layout.indices.numel()} pages exceeds the graphs' "
                             f"{self._graph_indices.numel()}")
        for wl in windows:
            self._plan_decode(md.graph[wl], md, wl)
        fb.attn_metadata = md
