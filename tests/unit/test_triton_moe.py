"""`common/layers/triton_moe.py`'s fused experts under Triton's interpreter (CPU tensors), against
`moe.grouped_experts`: one, a few and more tokens than a block, 4 and 8 experts, top-1 and top-2, hidden
and intermediate sizes that are not multiples of the 16-wide blocks, an expert no token picks, every token
on one expert, float32, float16 and bfloat16, strided weights, the CUDA block sizes; and the align step's
blocks themselves.

Blocks are 16 wide (the least `tl.dot` takes) but in the CUDA-size test, and shapes tiny: the interpreter
runs every program in Python."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and the kernel module are imported
pytest.importorskip("triton", reason="triton is not installed (make setup installs triton==3.6.0)")

from common.layers.moe import grouped_experts  # noqa: E402
from common.layers.triton_kernels import interpreted  # noqa: E402
from common.layers.triton_moe import fused_experts, moe_align  # noqa: E402
from tests.model_harness import one_torch_thread  # noqa: E402, F401  (autouse)

if not interpreted():
    pytest.skip(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} when triton was imported: no interpreter "
                "for CPU tensors", allow_module_level=True)

BLOCKS = dict(block_m=16, block_n=16, block_k=16)
# relative to the reference's largest output; the half types' own rounding of x, h and the output
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def make_case(t, e, k, hidden, inter, seed, ids=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen)
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5
    if ids is None:
        ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :k]  # k distinct experts per token
    weights = torch.rand(t, k, generator=gen).softmax(-1)
    return x, w13, w2, weights, ids


def check(x, w13, w2, weights, ids, dtype=torch.float32):
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    ref = grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = fused_experts(x, w13, w2, weights, ids, **BLOCKS)
    assert out.dtype == dtype and out.shape == x.shape
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return out


@pytest.mark.parametrize("t,e,k,hidden,inter", [
    (1, 4, 1, 48, 40),
    (1, 8, 2, 32, 16),
    (7, 4, 2, 48, 40),
    (7, 8, 1, 20, 24),
    (33, 8, 2, 48, 40),
    (33, 4, 1, 16, 48),
])
def test_matches_grouped_experts(t, e, k, hidden, inter):
    check(*make_case(t, e, k, hidden, inter, seed=t * 10 + e + k))


def test_matches_grouped_experts_same_dtype():
    """Against the reference at the same float32 inputs (not only float64): the rows agree closely."""
    x, w13, w2, weights, ids = make_case(7, 4, 2, 48, 40, seed=1)
    ref = grouped_experts(x, w13, w2, weights, ids)
    out = fused_experts(x, w13, w2, weights, ids, **BLOCKS)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_unpicked_expert_and_one_expert():
    """Experts 1 and 3 picked by no token (their weights poisoned with NaN: never read); then all 33
    tokens on expert 2 (three blocks of it, the last one part padding)."""
    x, w13, w2, weights, _ = make_case(9, 4, 2, 48, 40, seed=2)
    ids = torch.tensor([[0, 2], [2, 0]] * 4 + [[2, 0]])
    w13[[1, 3]] = float("nan")
    w2[[1, 3]] = float("nan")
    out = check(x, w13, w2, weights, ids)
    assert torch.isfinite(out).all()
    x, w13, w2, weights, _ = make_case(33, 8, 1, 48, 40, seed=3)
    check(x, w13, w2, weights, torch.full((33, 1), 2))


def test_align_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # pairs 0..5 -> experts 3 0 3 1 0 3; expert 2 unpicked
    pairs, block_expert, num_blocks = moe_align(ids, 4, 4)
    assert num_blocks.tolist() == [3]
    # bound: (6 + 4 * 3) // 4 = 4 blocks
    assert block_expert.tolist() == [0, 1, 3, 0]
    s = 6
    assert pairs.tolist() == [1, 4, s, s, 3, s, s, s, 0, 2, 5, s, s, s, s, s]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types(dtype):
    """float16 dots run in float16 under the interpreter; bfloat16 ones on float32 operands (the
    interpreter cannot multiply bfloat16), both accumulating in float32."""
    check(*make_case(7, 8, 2, 48, 40, seed=4), dtype=dtype)


def test_strided_weights_and_cuda_blocks():
    """Expert weights as views with gaps between rows and experts (every stride but the last column's
    honoured), and the block sizes a CUDA launch takes (64 rows, 64 columns, 64 deep) on sizes below them."""
    x, w13, w2, weights, ids = make_case(33, 4, 2, 48, 40, seed=6)
    big13 = torch.full((4, 2 * 40 + 3, 48 + 5), float("nan"))
    big13[:, :80, :48] = w13
    big2 = torch.full((4, 48 + 2, 40 + 7), float("nan"))
    big2[:, :48, :40] = w2
    v13, v2 = big13[:, :80, :48], big2[:, :48, :40]
    assert not v13.is_contiguous() and not v2.is_contiguous()
    ref = grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    for out in (fused_experts(x, v13, v2, weights, ids, **BLOCKS), fused_experts(x, w13, w2, weights, ids)):
        assert (out.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()

