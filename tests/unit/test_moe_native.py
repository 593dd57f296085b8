"""The native expert computation (common/layers/moe_native.py, moe_experts.c) against the torch
`grouped_experts` it replaces: shapes with feature counts off the 8-wide vectors, experts nobody picks,
every token on one expert, both the serial and the OpenMP path; and None where the kernel cannot be used."""

from __future__ import annotations

import os

import pytest
import torch

from common.layers import native
from common.layers.moe import grouped_experts
from common.layers.moe_native import native_grouped_experts

# the kernel must be there wherever the build can give it (AVX2 + FMA, kernels on)
pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= native._cpu_flags()
                                or os.environ.get("PDSERVE_NATIVE_KERNELS") == "0",
                                reason="no AVX2 + FMA or native kernels off")


def _case(t: int, e: int, k: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    weights, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def _check(x, w13, w2, weights, ids) -> torch.Tensor:
    got = native_grouped_experts(x, w13, w2, weights, ids)
    assert got is not None
    ref = grouped_experts(x, w13, w2, weights, ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    scale = ref.abs().max().item()
    assert scale > 0
    assert (got - ref).abs().max().item() <= 1e-5 * scale
    return got


def test_kernel_loads():
    assert native.moe_experts() is not None


@pytest.mark.parametrize("t", [1, 3, 17, 64])
@pytest.mark.parametrize("e", [4, 8, 16])
@pytest.mark.parametrize("k", [1, 2])
def test_matches_grouped_experts(t, e, k):
    _check(*_case(t, e, k, 48, 40, seed=t * 100 + e * 10 + k))


@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 37, 21), (5, 6, 3, 37, 21), (40, 8, 2, 61, 19),
                                       (2, 4, 2, 3, 5), (9, 8, 2, 576, 256), (33, 16, 4, 100, 70)])
def test_features_off_the_vector_width(t, e, k, h, i):
    _check(*_case(t, e, k, h, i, seed=h + i))


def test_unused_experts_are_not_read():
    x, w13, w2, weights, ids = _case(17, 8, 2, 48, 40, seed=3)
    ids = torch.where(ids == 5, 6, ids)  # nobody picks 5; a token may now pick 6 twice, still a sum
    ids = torch.where(ids == 0, 1, ids)
    w13[5] = float("nan")
    w2[0] = float("nan")
    got = _check(x, w13, w2, weights, ids)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("t", [1, 7, 64])
def test_all_tokens_on_one_expert(t):
    x, w13, w2, weights, ids = _case(t, 8, 1, 48, 40, seed=t)
    _check(x, w13, w2, torch.rand(t, 1), torch.full((t, 1), 3))
    both = torch.tensor([[3, 6]]).expand(t, 2).contiguous()  # and every token on the same two
    _check(x, w13, w2, torch.rand(t, 2), both)


def test_same_bits_on_any_thread_count():
    case = _case(64, 16, 2, 576, 256, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_grouped_experts(*case)
        torch.set_num_threads(2)
        two = native_grouped_experts(*case)
    finally:
        torch.set_num_threads(before)
    assert one is not None and torch.equal(one, two)


def test_no_tokens():
    x, w13, w2, weights, ids = _case(0, 4, 2, 48, 40)
    out = native_grouped_experts(x, w13, w2, weights, ids)
    assert out is not None and out.shape == (0, 48)


def test_strided_activations_are_taken():
    x, w13, w2, weights, ids = _case(6, 8, 2, 48, 40, seed=4)
    wide = torch.randn(6, 100)
    wide[:, 10:58] = x
    _check(wide[:, 10:58], w13, w2, weights, ids)


def test_bad_expert_id_raises():
    x, w13, w2, weights, ids = _case(3, 4, 2, 48, 40)
    ids[1, 0] = 4
    with pytest.raises(ValueError):
        native_grouped_experts(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_get_none(dtype):
    x, w13, w2, weights, ids = _case(3, 4, 2, 48, 40)
    assert native_grouped_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids) is None
    assert native_grouped_experts(x.to(dtype), w13, w2, weights, ids) is None
    assert native_grouped_experts(x, w13.to(dtype), w2, weights, ids) is None


def test_unusable_inputs_get_none(monkeypatch):
    x, w13, w2, weights, ids = _case(3, 4, 2, 48, 40)
    assert native_grouped_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights,
                                  ids) is None  # expert weights not contiguous
    assert native_grouped_experts(x, w13, w2, weights, ids.int()) is None
    assert native_grouped_experts(x, w13[:, :-1], w2, weights, ids) is None  # odd gate/up rows
    assert native_grouped_experts(x, w13, w2[:, :, :-1], weights, ids) is None  # down of another width
    assert native_grouped_experts(x.to("meta"), w13, w2, weights, ids) is None  # not host memory
    monkeypatch.setattr(native, "moe_experts", lambda: None)  # no kernel (PDSERVE_NATIVE_KERNELS=0)
    assert native_grouped_experts(x, w13, w2, weights, ids) is None


def test_run_experts_takes_the_kernel_for_few_pairs_per_expert():
    """The block's dispatch: the native kernel while the experts average under NATIVE_MAX_PAIRS_PER_EXPERT
    pairs (its bits exactly), torch's loop above (its bits exactly)."""
    from common.layers.moe import NATIVE_MAX_PAIRS_PER_EXPERT, run_experts

    few = _case(9, 4, 2, 48, 40, seed=3)
    assert torch.equal(run_experts(*few), native_grouped_experts(*few))
    t = NATIVE_MAX_PAIRS_PER_EXPERT + 1  # 2 experts, k=2: t pairs each on average, just over
    many = _case(t, 2, 2, 16, 8, seed=4)
    assert torch.equal(run_experts(*many), grouped_experts(*many))
