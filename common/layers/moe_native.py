"""The experts of a mixture-of-experts block through one native call (`moe_experts.c`).

`common.layers.moe.grouped_experts` sorts the batch's (token, choice) pairs by expert and loops in Python
over the experts that were picked, two `F.linear`s and an activation each; at decode batch sizes each
expert holds a token or two and that per-expert dispatch, not the arithmetic, is the cost.
`native_grouped_experts` computes the same sum in a single C call:

* the pairs are counting-sorted by expert; experts nobody picked are not read;
* gate/up: the work items are (used expert, tile of 16 intermediate features), shared out over the
  OpenMP team (torch's, so `torch.set_num_threads` holds), so even one token keeps every core busy;
  each block of weight rows is read from memory once and crossed with all of that expert's tokens, up
  to 6 at a time in registers (AVX2 FMA dot products), the next block prefetched meanwhile; the result
  is silu(gate) * up per pair;
* down: the work items are chunks of the output features; each runs every used expert's rows of `w2`
  in the chunk over that expert's activations and adds the routing-weighted dots straight into the
  output rows (no two threads write one element: no atomics, no per-pair rows to reduce). The result
  has the same bits on any thread count.

Large batches (prefill) are better served by torch's blocked GEMMs; the caller picks by token count.
Float32 only: anything else (another dtype, a GPU tensor, non-contiguous expert weights, builds without
AVX2 + FMA, `PDSERVE_NATIVE_KERNELS=0`) gets None and the caller keeps the torch path.
"""

from __future__ import annotations

import torch

from common.layers import native


def native_grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> torch.Tensor | None:
    """`grouped_experts(x, w13, w2, weights, ids)` as one native call: x [T, H], w13 [E, 2I, H], w2
    [E, H, I], weights [T, k], ids [T, k] -> [T, H]; None where the kernel cannot take these tensors."""
    kernel = native.moe_experts()
    # (native.cpu_tensors' guard, by `is_cpu`: reading `.device` costs more than the rest of the checks)
    if kernel is None or not (x.is_cpu and w13.is_cpu and w2.is_cpu and weights.is_cpu and ids.is_cpu):
        return None
    f32 = torch.float32
    if not (x.dtype is f32 and w13.dtype is f32 and w2.dtype is f32 and weights.dtype is f32
            and ids.dtype is torch.int64):
        return None
    if x.dim() != 2 or w13.dim() != 3 or ids.dim() != 2 or weights.shape != ids.shape:
        return None
    if not (w13.is_contiguous() and w2.is_contiguous()):  # the expert weights are never copied here
        return None
    t, h = x.shape
    e, i2, _ = w13.shape
    inter = i2 // 2
    if w13.shape[2] != h or i2 != 2 * inter or w2.shape != (e, h, inter) or ids.shape[0] != t:
        return None
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    out = torch.empty(t, h, dtype=torch.float32)
    rc = kernel(x.data_ptr(), t, h, w13.data_ptr(), w2.data_ptr(), e, inter, weights.data_ptr(),
                ids.data_ptr(), ids.shape[1], out.data_ptr())
    if rc == -2:
        raise ValueError(f"MoE expert ids outside [0, {e})")
    return out if rc == 0 else None
