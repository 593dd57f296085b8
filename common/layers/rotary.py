"""Rotary position embedding (neox / rotate-half style, as Hugging Face Llama), with a cos/sin
cache precomputed for every position and gathered once per forward by position.

Supported `rope_type`s: "default", "linear", "llama3". Others raise a clear error at load time.
"""

from __future__ import annotations

import math

import torch

from common.layers.native import cpu_tensors, rotary_apply

_native_rotary = rotary_apply()

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(rotary_dim: int, base: float, rope_type: str = "default",
                     scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    scaling = scaling or {}
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding:
    """cos/sin tables `[max_positions, rotary_dim / 2]`; `cos_sin(positions)` once per forward, then
    `apply(x, cos, sin)` on q and k of every layer."""

    def __init__(self, head_dim: int, max_positions: int, base: float, rope_type: str = "default",
                 scaling: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.head_dim = head_dim
        self.dtype = dtype
        self.inv_freq = compute_inv_freq(head_dim, base, rope_type, scaling)
        self._build(max(int(max_positions), 1))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.int64, device=self.inv_freq.device).float()
        freqs = torch.outer(t, self.inv_freq)
        self.cos_cache = freqs.cos().to(self.dtype)
        self.sin_cache = freqs.sin().to(self.dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, rotary_dim / 2]` cos and sin for the given positions (broadcast over heads)."""
        # on a GPU the check would wait for the device (and cannot be captured in a graph): there the tables
        # cover the model's context length, which the runner never lets a request pass
        if positions.is_cpu and positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            self._build(2 * int(positions.max()) + 1)
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[T, heads, head_dim]` (any strides) into a new contiguous tensor. The native
        kernel (`rotary.c`) takes float32 with heads packed within a token."""
        half = x.shape[-1] // 2
        if (_native_rotary is not None and cpu_tensors(x) and x.dtype == torch.float32
            and x.dim() == 3 and x.stride(2) == 1
                and x.stride(1) == x.shape[2] and cos.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape[-1] == half and cos.shape[0] == x.shape[0]):
            t, heads, d = x.shape
            out = torch.empty(t, heads, d, dtype=x.dtype)
            _native_rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                           out.data_ptr(), t, heads, d)
            return out
        x1 = x[..., :half]
        x2 = x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1 = out[..., :half]
        o2 = out[..., half:]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        return out
