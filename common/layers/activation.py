"""The MLP's activation: `silu(gate) * up` on a fused `[.., gate | up]` projection output.

Float32 CPU rows with a contiguous last dimension go through the native kernel (`activation.c`, one pass
over the row); everything else, and builds without the kernels, through `F.silu(gate) * up`. On a
16 x (2 x 1536) batch here the two torch ops take ~65 us, this function ~35 us (~14 of them in the
kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.layers import native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[..., 2n]` -> `[..., n]`: silu of the first half times the second half."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n) if gate_up.dim() != 2 else gate_up
    kernel = native.silu_and_mul()
    if kernel is None or not native.cpu_tensors(rows) or rows.dtype != torch.float32 or rows.stride(-1) != 1:
        gate, up = gate_up.split(n, dim=-1)
        return F.silu(gate) * up
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    kernel(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], n)
    return out.view(*gate_up.shape[:-1], n)
