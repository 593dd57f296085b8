"""Triton kernels of the `triton` attention backend, and the functions that launch them.

Every kernel reads and writes the KV pool through its flat `[rows, head_dim]` view
(`common/memory/kv_pool.py`) and finds a token's rows from its slot inside the kernel: slot `s` of
KV head `h` in layer `l` is row `(s // page_size) * page_rows + layer_offset(l) + h * page_size +
s % page_size`, its V row that plus `v_offset`. A request's slots come from its row of
`req_to_token`, so K/V are read in place, never gathered into a copy.

* `store_kv`: the new tokens' K and V (cast to the pool's dtype first) into their slots
  (`out_cache_loc`); grid (tokens, KV heads).
* `decode_attention`: flash-decoding in two stages. Stage 1, grid (requests, KV heads, splits):
  split `i` of a request covers the i-th of `num_splits` equal parts of the keys it attends to
  (every key, or the last `window`) and leaves, for each query head of the KV head's group, its
  partial softmax: the normalised weighted sum of V and the log-sum-exp of its scores. Stage 2, grid
  (requests, heads), merges a request's splits. Each split finds its range from the request's
  `seq_lens` entry, so the grid depends on the batch size only (a CUDA graph replays it unchanged).
* `extend_attention`: grid (query blocks of the whole batch, heads); block `b` is `block_m[b]`
  onwards of request `block_req[b]`'s new tokens. It attends first to the request's cached prefix
  (from the pool) and then causally to the new tokens' K/V (from the k and v tensors), both with
  the online softmax.

GQA: a decode program loads its KV head's whole group of query heads as the rows of one tile,
padded to a power of two of at least 16 (the least `tl.dot` takes) and masked. Head sizes that
are not powers of two (or below 16) are padded the same way and masked on load and store.

Key loops: `for` over runtime bounds, which the compiler pipelines; the interpreter runs the same loops
(it needs numpy below 2.4, which turns down the `int()` of a one-element array it takes a runtime bound
with: triton-lang/triton#9171; the project pins numpy for that).

Numerics: scores, softmax and accumulators are float32. The dots run in the inputs' half type when
q and the pool share one (bfloat16 or float16), else on float32 operands at IEEE precision (a
float32 dot would run at TF32 by default). The interpreter keeps bfloat16 as raw 16-bit integers,
which its matmul cannot multiply, so on CPU tensors a bfloat16 dot runs on float32 operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# no window: a bound larger than any context
NO_WINDOW = 1 << 30


@triton.jit
def _dot(a, b, HALF_DOT: tl.constexpr):
    if HALF_DOT:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _operand(x, HALF_DOT: tl.constexpr):
    """A loaded tile as a dot operand: its own half type, or float32."""
    if HALF_DOT:
        out = x
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _kv_rows(slot, head, page_rows, layer_off, PAGE_SIZE: tl.constexpr):
    """Flat pool rows of layer K for `slot` (any shape) of KV head `head`."""
    return (slot // PAGE_SIZE) * page_rows + layer_off + head * PAGE_SIZE + slot % PAGE_SIZE


@triton.jit
def _softmax_step(s, vis, m_i, l_i, acc, v, HALF_DOT: tl.constexpr):
    """One block of the online softmax: `s` scores (log2 units) `[M, N]`, `vis` the visible ones, `v`
    `[N, D]`; returns the updated row maxima, sums and weighted sums."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, HALF_DOT)
    return m_new, l_i, acc


@triton.jit
def _paged_block(n0, end, q, q_pos, m_i, l_i, acc, flat_ptr, slots_ptr, kv_head, page_rows, layer_off, v_off,
                 qk_scale, window, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HALF_DOT: tl.constexpr):
    """Keys `n0..n0 + BLOCK_N - 1` (those before `end`) of a request, read from the pool through its slots
    (`slots_ptr`: its req_to_token row); a key is visible to the query at `q_pos` inside its window."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    nmask = n < end
    kv_mask = nmask[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.load(slots_ptr + n, mask=nmask, other=0)
    rows = _kv_rows(slot, kv_head, page_rows, layer_off, PAGE_SIZE)
    k = tl.load(flat_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(flat_ptr + (rows + v_off)[:, None] * HEAD_DIM + d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(_operand(k, HALF_DOT)), HALF_DOT) * qk_scale
    vis = nmask[None, :] & (n[None, :] > q_pos[:, None] - window)
    return _softmax_step(s, vis, m_i, l_i, acc, _operand(v, HALF_DOT), HALF_DOT)


@triton.jit
def _new_block(n0, n_new, m, q, m_i, l_i, acc, k_ptr, stride_k, v_ptr, stride_v, qk_scale, window,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HALF_DOT: tl.constexpr):
    """New tokens `n0..n0 + BLOCK_N - 1` of a request as keys (rows of k and v from its first new token
    on, its KV head's columns) for its new tokens `m`: causal, inside the window."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    nmask = n < n_new
    kv_mask = nmask[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + n[:, None] * stride_k + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + n[:, None] * stride_v + d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(_operand(k, HALF_DOT)), HALF_DOT) * qk_scale
    vis = nmask[None, :] & (n[None, :] <= m[:, None]) & (n[None, :] > m[:, None] - window)
    return _softmax_step(s, vis, m_i, l_i, acc, _operand(v, HALF_DOT), HALF_DOT)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, stride_k, stride_v, loc_ptr, flat_ptr, page_rows, layer_off, v_off,
                     PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    slot = tl.load(loc_ptr + t)
    row = _kv_rows(slot, head, page_rows, layer_off, PAGE_SIZE)
    k = tl.load(k_ptr + t * stride_k + head * HEAD_DIM + d, mask=dmask)
    v = tl.load(v_ptr + t * stride_v + head * HEAD_DIM + d, mask=dmask)
    tl.store(flat_ptr + row * HEAD_DIM + d, k, mask=dmask)
    tl.store(flat_ptr + (row + v_off) * HEAD_DIM + d, v, mask=dmask)


@triton.jit
def _decode_stage1_kernel(q_ptr, stride_q, flat_ptr, r2t_ptr, stride_r2t, req_rows_ptr, seq_lens_ptr,
                          mid_o_ptr, mid_lse_ptr, page_rows, layer_off, v_off, qk_scale, window,
                          NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HALF_DOT: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    slots_ptr = r2t_ptr + tl.load(req_rows_ptr + b) * stride_r2t
    lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(seq_len - lo, NUM_SPLITS)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_q + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        q = _operand(q, HALF_DOT)
        m_i = tl.full([BLOCK_G], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        q_pos = seq_len - 1 + tl.zeros([BLOCK_G], tl.int32)
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _paged_block(n0, end, q, q_pos, m_i, l_i, acc, flat_ptr, slots_ptr, kv_head,
                                         page_rows, layer_off, v_off, qk_scale, window, PAGE_SIZE, HEAD_DIM,
                                         BLOCK_N, BLOCK_D, HALF_DOT)
        mid = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None],
                 mask=gmask[:, None] & dmask[None, :])
        tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=gmask)


@triton.jit
def _decode_stage2_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_o, seq_lens_ptr, window,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(seq_len - lo, NUM_SPLITS)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    # the splits stage 1 filled: those whose range is not empty (split 0 always is not)
    valid = (sp < NUM_SPLITS) & (lo + sp * split_len < seq_len)
    mid = (b * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(mid_lse_ptr + mid, mask=valid, other=float("-inf"))
    part = tl.load(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :],
                   mask=valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_o + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _extend_kernel(q_ptr, stride_q, k_ptr, stride_k, v_ptr, stride_v, out_ptr, stride_o, flat_ptr, r2t_ptr,
                   stride_r2t, req_rows_ptr, q_start_ptr, ext_lens_ptr, prefix_lens_ptr, block_req_ptr,
                   block_m_ptr, page_rows, layer_off, v_off, qk_scale, window,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HALF_DOT: tl.constexpr):
    blk = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    r = tl.load(block_req_ptr + blk)
    m0 = tl.load(block_m_ptr + blk)
    q_start = tl.load(q_start_ptr + r)
    n_new = tl.load(ext_lens_ptr + r)
    prefix = tl.load(prefix_lens_ptr + r)
    slots_ptr = r2t_ptr + tl.load(req_rows_ptr + r) * stride_r2t

    m = m0 + tl.arange(0, BLOCK_M)  # index among the request's new tokens
    d = tl.arange(0, BLOCK_D)
    mmask = m < n_new
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_q + head * HEAD_DIM + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    q = _operand(q, HALF_DOT)
    q_pos = prefix + m
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # the cached prefix, through req_to_token, from the oldest key the block's first query sees; then the
    # new tokens (their K/V as given), causal: up to the block's last query
    p_lo = tl.maximum(prefix + m0 - window + 1, 0)
    n_lo = tl.maximum(m0 - window + 1, 0)
    n_hi = tl.minimum(m0 + BLOCK_M, n_new)
    k_new = k_ptr + q_start * stride_k + kv_head * HEAD_DIM
    v_new = v_ptr + q_start * stride_v + kv_head * HEAD_DIM
    for n0 in range(p_lo, prefix, BLOCK_N):
        m_i, l_i, acc = _paged_block(n0, prefix, q, q_pos, m_i, l_i, acc, flat_ptr, slots_ptr, kv_head,
                                     page_rows, layer_off, v_off, qk_scale, window, PAGE_SIZE, HEAD_DIM,
                                     BLOCK_N, BLOCK_D, HALF_DOT)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        m_i, l_i, acc = _new_block(n0, n_new, m, q, m_i, l_i, acc, k_new, stride_k, v_new, stride_v,
                                   qk_scale, window, HEAD_DIM, BLOCK_N, BLOCK_D, HALF_DOT)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_o + head * HEAD_DIM + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


# ---------------------------------------------------------------------------- launches
def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (`TRITON_INTERPRET=1` when triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_store_kv_kernel, InterpretedFunction)


def half_dot(q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the dots can run in the inputs' own half type (see the module docstring)."""
    if q_dtype != kv_dtype or q_dtype not in (torch.bfloat16, torch.float16):
        return False
    return device.type == "cuda" or q_dtype == torch.float16


def _block_d(head_dim: int) -> int:
    """The head size padded for the dots: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A `[T, n * head_dim]` tensor whose elements within a row are contiguous (a slice of qkv is)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(pool, layer_id: int, k: torch.Tensor, v: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
    """Write new tokens' k, v `[T, kv_heads * head_dim]` into their slots `out_cache_loc` `[T]`. A cast to
    the pool's dtype is torch's (round to nearest even, as `KVPool.set_kv_rows`): the interpreter's own
    float32 -> bfloat16 conversion truncates."""
    t = k.shape[0]
    if t == 0:
        return
    k, v = _rows(k.to(pool.dtype)), _rows(v.to(pool.dtype))
    d = pool.head_dim
    _store_kv_kernel[(t, pool.kv_heads)](
        k, v, k.stride(0), v.stride(0), out_cache_loc, pool.flat, pool.page_rows, pool.layer_offset(layer_id),
        pool.v_offset, PAGE_SIZE=pool.page_size, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))


def decode_attention(q: torch.Tensor, out: torch.Tensor, pool, layer_id: int, req_to_token: torch.Tensor,
                     req_rows: torch.Tensor, seq_lens: torch.Tensor,
                     mid_o: torch.Tensor, mid_lse: torch.Tensor,
                     *, num_heads: int, scaling: float, window: int | None, block_n: int, num_warps: int = 4,
                     num_stages: int = 2) -> None:
    """One query per request: q `[B, heads * head_dim]` -> out (same shape), over the first `seq_lens[b]`
    tokens of `req_to_token[req_rows[b]]` (the last `window` of them when given). `mid_o`
    `[B, heads, splits, head_dim]` and `mid_lse` `[B, heads, splits]` (float32) hold the splits' partial
    results between the two stages."""
    b = q.shape[0]
    if b == 0:
        return
    q = _rows(q)
    kv_heads, d = pool.kv_heads, pool.head_dim
    group = num_heads // kv_heads
    splits = mid_lse.shape[-1]
    win = NO_WINDOW if window is None else window
    block_d = _block_d(d)
    _decode_stage1_kernel[(b, kv_heads, splits)](
        q, q.stride(0), pool.flat, req_to_token, req_to_token.stride(0), req_rows, seq_lens, mid_o, mid_lse,
        pool.page_rows, pool.layer_offset(layer_id), pool.v_offset, scaling * LOG2E, win,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=d, PAGE_SIZE=pool.page_size, NUM_SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        HALF_DOT=half_dot(q.dtype, pool.dtype, q.device), num_warps=num_warps, num_stages=num_stages)
    _decode_stage2_kernel[(b, num_heads)](
        mid_o, mid_lse, out, out.stride(0), seq_lens, win, NUM_HEADS=num_heads, HEAD_DIM=d, NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, pool, layer_id: int,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, q_start: torch.Tensor,
                     ext_lens: torch.Tensor, prefix_lens: torch.Tensor, block_req: torch.Tensor,
                     block_m: torch.Tensor, *, num_heads: int, scaling: float,
                     window: int | None, block_size_m: int,
                     block_n: int, num_warps: int = 4, num_stages: int = 2) -> None:
    """Causal attention of each request's new tokens (rows `q_start[r]..+ext_lens[r]` of q `[T, heads *
    head_dim]`, their K/V in k, v `[T, kv_heads * head_dim]`) over its `prefix_lens[r]` cached tokens and
    themselves. `block_req`/`block_m`: per query block of `block_size_m` rows, its request and first row."""
    nb = block_req.shape[0]
    if nb == 0:
        return
    q, k, v = _rows(q), _rows(k), _rows(v)
    d = pool.head_dim
    dot_half = half_dot(q.dtype, pool.dtype, q.device) and k.dtype == q.dtype and v.dtype == q.dtype
    _extend_kernel[(nb, num_heads)](
        q, q.stride(0), k, k.stride(0), v, v.stride(0), out, out.stride(0), pool.flat, req_to_token,
        req_to_token.stride(0), req_rows, q_start, ext_lens, prefix_lens, block_req, block_m, pool.page_rows,
        pool.layer_offset(layer_id), pool.v_offset, scaling * LOG2E, NO_WINDOW if window is None else window,
        GROUP=num_heads // pool.kv_heads, HEAD_DIM=d, PAGE_SIZE=pool.page_size, BLOCK_M=block_size_m,
        BLOCK_N=block_n, BLOCK_D=_block_d(d), HALF_DOT=dot_half, num_warps=num_warps,
        num_stages=num_stages)
