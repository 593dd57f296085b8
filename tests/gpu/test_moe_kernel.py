"""The fused mixture-of-experts Triton kernels compiled for the GPU (`common/layers/triton_moe.py`) against
the reference expert loop at a Qwen3-MoE-like shape (128 experts, top 8), in float32 (IEEE dots) and
bfloat16, for a decode batch and a prefill chunk; and under a CUDA graph (the kernels read nothing back to
the host)."""

from __future__ import annotations

import pytest
import torch

from common.layers.moe import grouped_experts


def _case(t: int, dtype: torch.dtype, e: int = 128, k: int = 8, h: int = 512, i: int = 192):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).to(dtype)
    weights, ids = torch.randn(t, e, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [3, 200])
def test_fused_matches_the_expert_loop(t, dtype, tol):
    from common.layers.triton_moe import fused_experts

    x, w13, w2, weights, ids = _case(t, dtype)
    ref = grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_fused_replays_in_a_cuda_graph():
    from common.layers.triton_moe import fused_experts

    x, w13, w2, weights, ids = _case(4, torch.float32)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = _case(5, torch.float32)  # new tokens and routing (its weights unused)
    x.copy_(x2[:4])
    weights.copy_(weights2[:4])
    ids.copy_(ids2[:4])
    graph.replay()
    torch.cuda.synchronize()
    ref = fused_experts(x, w13, w2, weights, ids)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
