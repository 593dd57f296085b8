"""The native CPU kernels (common/layers/*.c) against the torch paths they replace, on the shapes and
strides the models hand them; and the torch fallbacks when the kernels are off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers import native
from common.layers.norm import RMSNorm
from common.layers.rotary import RotaryEmbedding


def test_kernels_build_and_load():
    assert native.build().exists()
    assert native.paged_decode_attention() is not None
    assert native.add_rms_norm() is not None
    assert native.rotary_apply() is not None


def torch_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    h = x.double() if residual is None else x.double() + residual.double()
    out = norm.weight.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    return out, h


@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 x 576 takes the OpenMP path
def test_rms_norm_native_matches_reference(rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(torch.randn(576, generator=g))
    assert norm.native is not None
    wide = torch.randn(rows, 1000, generator=g) * 3
    x = wide[:, 100:676]  # a row stride, as a slice of a wider activation
    residual = torch.randn(rows, 576, generator=g)
    x_before, residual_before = x.clone(), residual.clone()
    out = norm(x)
    ref, _ = torch_rms_norm(norm, x, None)
    assert (out.double() - ref).abs().max().item() < 1e-5
    out, res = norm(x, residual)
    ref, h = torch_rms_norm(norm, x, residual)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (res.double() - h).abs().max().item() < 1e-6
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
    norm.native = None  # the F.rms_norm path gives the same
    out2, res2 = norm(x, residual)
    assert (out2 - out).abs().max().item() < 1e-5 and torch.equal(res2, res)


def test_rms_norm_on_3d_heads_takes_the_torch_path():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(4, 12 * 8)[:, :3 * 8].view(4, 3, 8)  # q heads of a fused qkv row
    assert not norm._native_ok(x, None)
    ref = F.rms_norm(x, (8,), norm.weight, 1e-6)
    assert torch.allclose(norm(x), ref)


@pytest.mark.parametrize("tokens,heads,d", [(1, 12, 64), (5, 3, 64), (600, 4, 32)])  # 600 x 4 x 32: OpenMP
def test_rotary_native_matches_torch_path(tokens, heads, d, monkeypatch):
    g = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(d, 4096, 10000.0)
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    cos, sin = rope.cos_sin(positions)
    qkv = torch.randn(tokens, (heads + 5) * d, generator=g)
    x = qkv[:, :heads * d].view(tokens, heads, d)
    out = RotaryEmbedding.apply(x, cos, sin)
    import common.layers.rotary as rotary

    monkeypatch.setattr(rotary, "_native_rotary", None)
    ref = RotaryEmbedding.apply(x, cos, sin)
    assert out.is_contiguous() and out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-5
    assert not torch.equal(out, x.contiguous())  # it really rotated
