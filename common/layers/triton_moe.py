"""Fused mixture-of-experts for the GPU engine: the experts of `common/layers/moe.py` as two Triton kernels.

`fused_experts(x, w13, w2, weights, ids)` has the contract of `moe.grouped_experts`: x `[T, H]`, w13
`[E, 2I, H]` (gate rows first, then up rows), w2 `[E, H, I]`, the router's `weights [T, k]` and
`ids [T, k]`; it returns `[T, H]` in x's dtype, each token the weighted sum of its k experts' outputs.
Where `grouped_experts` loops over the experts in Python, here every expert runs inside the same two
launches, whatever the routing, and no rows of x are copied into a gathered batch.

The T * k (token, choice) pairs are numbered `pair = t * k + j`. Four steps:

* align (torch ops): the pairs sorted by expert, each expert's group padded to a multiple of BLOCK_M
  with the sentinel `T * k`, give `sorted_pair_ids`; `block_expert` holds the expert of each block of
  BLOCK_M sorted rows, and `num_blocks` how many blocks the batch fills. The buffers are sized from the
  bound `T * k + E * (BLOCK_M - 1)` rows, never from the counts themselves, and nothing is read back to
  the host: the launches' grids depend on T, k and E only (a CUDA graph replays them unchanged), and a
  program whose block lies past `num_blocks` returns at once.
* kernel 1, grid (blocks, intermediate tiles): a program takes one block of BLOCK_M pairs, all of one
  expert, and a BLOCK_N tile of the intermediate features. It loads the pairs' token rows of x in place
  (row `pair // k`), multiplies them by the expert's gate and up rows in BLOCK_K steps over H, and writes
  `silu(gate) * up` to the pair's row of an intermediate `[T * k, I]` buffer (x's dtype).
* kernel 2, grid (blocks, hidden tiles): the same blocks' intermediate rows times `w2[e]^T`, over I in
  BLOCK_K steps, scaled by the pair's routing weight, into the pair's row of a float32 `[T * k, H]` buffer.
* combine: the k rows of each token summed (`view(T, k, H).sum(1)`) and cast to x's dtype.

Padding rows (the sentinel) load zeros and store nothing; tiles are masked at the edges, so H and I need
not be multiples of the block sizes. An expert no pair chose gets no block.

Numerics: accumulators, the SiLU and the routing weight are float32. As in `triton_kernels.py`, the dots
run in the inputs' half type when x and the weights share one (bfloat16 or float16), else on float32
operands at IEEE precision; under the interpreter (CPU tensors) a bfloat16 dot runs on float32 operands,
since the interpreter cannot multiply bfloat16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.layers.triton_kernels import _dot, _operand, half_dot


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ids [T, k]` -> (`sorted_pair_ids [max_blocks * block_m]`, `block_expert [max_blocks]`,
    `num_blocks [1]`), all int64 on ids' device. Rows of expert e's blocks hold the pairs that chose e
    (in pair order), then the sentinel `T * k`; blocks past `num_blocks` are all sentinel, expert 0."""
    flat = ids.reshape(-1).long()
    tk = flat.numel()
    dev = flat.device
    max_blocks = (tk + num_experts * (block_m - 1)) // block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    group_end = counts.cumsum(0)
    order = flat.argsort(stable=True)
    expert_of = flat[order]
    rank = torch.arange(tk, device=dev) - (group_end - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    sorted_pair_ids = torch.full((max_blocks * block_m,), tk, dtype=torch.int64, device=dev)
    sorted_pair_ids.scatter_(0, dest, order)
    block_start = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    num_blocks = padded_end[-1:] // block_m
    block_expert = torch.where(block_expert < num_experts, block_expert, 0)
    return sorted_pair_ids, block_expert, num_blocks


@triton.jit
def _gate_up_kernel(x_ptr, stride_xt, w_ptr, stride_we, stride_wn, stride_wk, inter_ptr, pairs_ptr,
                    block_expert_ptr, num_blocks_ptr, num_pairs, hidden, inter,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HALF_DOT: tl.constexpr):
    blk = tl.program_id(0)
    tile = tl.program_id(1)
    if blk < tl.load(num_blocks_ptr):
        e = tl.load(block_expert_ptr + blk).to(tl.int64)
        m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + m)
        valid = pair < num_pairs
        tok = pair // TOP_K
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < inter
        gate_ptr = w_ptr + e * stride_we + n[None, :] * stride_wn
        up_ptr = gate_ptr + inter * stride_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < hidden
            a = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0)
            a = _operand(a, HALF_DOT)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(gate_ptr + kk[:, None] * stride_wk, mask=wmask, other=0.0)
            wu = tl.load(up_ptr + kk[:, None] * stride_wk, mask=wmask, other=0.0)
            acc_gate += _dot(a, _operand(wg, HALF_DOT), HALF_DOT)
            acc_up += _dot(a, _operand(wu, HALF_DOT), HALF_DOT)
        h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        tl.store(inter_ptr + pair[:, None] * inter + n[None, :], h.to(inter_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(inter_ptr, w_ptr, stride_we, stride_wn, stride_wk, out_ptr, route_ptr, pairs_ptr,
                 block_expert_ptr, num_blocks_ptr, num_pairs, hidden, inter,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF_DOT: tl.constexpr):
    blk = tl.program_id(0)
    tile = tl.program_id(1)
    if blk < tl.load(num_blocks_ptr):
        e = tl.load(block_expert_ptr + blk).to(tl.int64)
        m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + m)
        valid = pair < num_pairs
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < hidden
        w_base = w_ptr + e * stride_we + n[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < inter
            a = tl.load(inter_ptr + pair[:, None] * inter + kk[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(w_base + kk[:, None] * stride_wk, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc += _dot(_operand(a, HALF_DOT), _operand(w, HALF_DOT), HALF_DOT)
        route = tl.load(route_ptr + pair, mask=valid, other=0.0)
        acc = acc * route[:, None]
        tl.store(out_ptr + pair[:, None] * hidden + n[None, :], acc, mask=valid[:, None] & nmask[None, :])


def _block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a CUDA launch: 16-row blocks while most experts get a few pairs
    (decode), 64 once the pairs fill larger blocks."""
    block_m = 16 if num_pairs <= 4 * num_experts else 64
    return block_m, 64, 64


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, *, block_m: int | None = None, block_n: int | None = None,
                  block_k: int | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) for every token t, as `moe.grouped_experts` (the
    module docstring says how). Block sizes default to the CUDA ones; each must be at least 16."""
    t, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    bm, bn, bk = _block_sizes(t * top_k, num_experts)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_pairs = t * top_k
    pairs, block_expert, num_blocks = moe_align(ids, num_experts, bm)
    max_blocks = block_expert.shape[0]
    dot_half = (w13.dtype == w2.dtype == x.dtype) and half_dot(x.dtype, w13.dtype, x.device)
    route = weights.reshape(-1).float().contiguous()

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(max_blocks, triton.cdiv(inter, bn))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), w13.stride(2), h, pairs, block_expert, num_blocks,
        num_pairs, hidden, inter, TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HALF_DOT=dot_half,
        num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(max_blocks, triton.cdiv(hidden, bn))](
        h, w2, w2.stride(0), w2.stride(1), w2.stride(2), out, route, pairs, block_expert, num_blocks,
        num_pairs, hidden, inter, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HALF_DOT=dot_half,
        num_warps=num_warps, num_stages=num_stages)
    return out.view(t, top_k, hidden).sum(1).to(x.dtype)
