"""RMSNorm, computed in float32 like the Hugging Face reference, with an optional fused residual add.

Float32 CPU rows with a contiguous last dimension go through the native kernel (`rms_norm.c`: add,
norm and scale in one pass); anything else through `F.rms_norm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.layers.native import add_rms_norm, cpu_tensors


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded.to(param.dtype))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.variance_epsilon = eps
        self.normalized_shape = (hidden_size,)
        self.native = add_rms_norm() if dtype == torch.float32 else None

    def _native_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (self.native is not None and cpu_tensors(x, residual) and x.dim() == 2
                and x.dtype == torch.float32
                and x.stride(1) == 1
                and (residual is None or (residual.dtype == torch.float32 and residual.stride(1) == 1)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`; with `residual`: `(norm(x + residual), x + residual)`."""
        if self._native_ok(x, residual):
            rows, n = x.shape
            out = torch.empty(rows, n, dtype=x.dtype)
            res_out = None if residual is None else torch.empty(rows, n, dtype=x.dtype)
            self.native(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                        0 if residual is None else residual.stride(0),
                        None if res_out is None else res_out.data_ptr(),
                        self.weight.data_ptr(), out.data_ptr(), rows, n, self.variance_epsilon)
            return out if residual is None else (out, res_out)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.normalized_shape, self.weight, self.variance_epsilon)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)
