"""RMSNorm, computed in float32 like the Hugging Face reference, with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`; with `residual`: `(norm(x + residual), x + residual)`."""
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
