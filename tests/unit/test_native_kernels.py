"""The native CPU kernels (common/layers/*.c) against the torch paths they replace, on the shapes and
strides the models hand them; and the torch fallbacks when the kernels are off. A second, AVX2-only build
against this one: tests/fresh_process/test_native_builds.py."""

from __future__ import annotations

import time

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
    assert native.packed_gemm() is not None  # this machine has AVX2 + FMA


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


@pytest.mark.parametrize("out_features,in_features", [(1, 8), (17, 37), (100, 576), (48, 16)])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 16, 33, 200])
def test_panel_gemm_matches_float64(rows, out_features, in_features):
    """Every row-tile height (1..6 and their mix), output widths that end inside a 16-column panel,
    with and without bias, on a strided slice of a wider activation; 200 rows: a prefill chunk's matmul,
    which leaves the weights' prefetching to the hardware."""
    from common.layers.linear import PANEL, linear, pack_weight

    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    packed = pack_weight(weight)
    assert packed.scale is None and packed.weight.shape == (-(-out_features // PANEL), in_features, PANEL)
    wide = torch.randn(rows, in_features + 9, generator=g)
    x = wide[:, 3:3 + in_features]
    for b in (None, bias):
        out = linear(x, weight, packed, b)
        ref = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        if rows:
            assert (out.double() - ref).abs().max().item() < 1e-5 * in_features ** 0.5 * 4



@pytest.mark.parametrize("quantization", [None, "int8wo"])
def test_panel_gemm_gives_each_row_the_same_bits_in_any_batch(quantization):
    """Batches of 1 to 26 rows split into row blocks of every height (8 rows as 4 + 4, 13 as 5 + 4 + 4, 26
    over several blocks): each output sums over k in the same order whatever block its row lands in, so
    every row of a batch equals, bit for bit, the same row computed alone."""
    from common.layers.linear import linear, pack_weight

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 150, generator=g)
    bias = torch.randn(40, generator=g)
    packed = pack_weight(weight, quantization=quantization) if quantization else pack_weight(weight)
    x = torch.randn(26, 150, generator=g)
    alone = torch.cat([linear(x[i:i + 1], weight, packed, bias) for i in range(26)])
    for rows in range(2, 27):
        assert torch.equal(linear(x[:rows], weight, packed, bias), alone[:rows]), rows
    # past the rows where the tiles stop prefetching the weights (gemm.c's PREFETCH_ROWS): the same bits
    big = torch.cat([x] * 6)
    assert torch.equal(linear(big, weight, packed, bias), torch.cat([alone] * 6))

def strided_outputs(rows: int, weight, packed, bias, g):
    """A strided activation (rows inside a wider tensor), and `linear`'s output without and with the bias."""
    from common.layers.linear import linear

    x = torch.randn(rows, weight.shape[1] + 9, generator=g)[:, 3:3 + weight.shape[1]]
    for b in (None, bias):
        out = linear(x, weight, packed, b)
        assert out.shape == (rows, weight.shape[0])
        yield x, b, out


@pytest.mark.parametrize("out_features,in_features", [(1, 8), (17, 37), (100, 576), (3072, 64)])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 16, 33])
def test_int8_panel_gemm_matches_the_dequantized_weight(rows, out_features, in_features):
    """`--torchao-config int8wo`: int8 panels with a scale per output column give x @ (q * scale)^T + b
    in float32 (every row-tile height, panels that end inside, bias or not, a strided activation), stay
    within int8's rounding of the float32 product, and give each row the same bits whatever the batch
    (every row tile sums from zero in k order and scales once)."""
    from common.layers.linear import PANEL, linear, pack_weight, quantize_int8

    g = torch.Generator().manual_seed(rows * 1000 + out_features + 1)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    packed = pack_weight(weight, quantization="int8wo")
    panels = -(-out_features // PANEL)
    assert packed.weight.dtype == torch.int8 and packed.weight.shape == (panels, in_features, PANEL)
    assert packed.scale.shape == (panels * PANEL,)
    q, scale = quantize_int8(weight)
    assert q.abs().max() <= 127 and torch.allclose(q.float() * scale[:, None], weight,
                                                   atol=scale.max().item() / 2 + 1e-7)
    for x, b, out in strided_outputs(rows, weight, packed, bias, g):
        if not rows:
            continue
        deq = x.double() @ (q.double() * scale.double()[:, None]).T + (0 if b is None else b.double())
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert (out.double() - deq).abs().max().item() < 1e-5 * in_features ** 0.5 * 4
        # int8 rounding: each weight within half a step, so the error grows like sqrt(K) * step * |x|
        assert (out.double() - exact).abs().max().item() < 0.05 * in_features ** 0.5
        assert torch.equal(linear(x[-1:], weight, packed, b), out[-1:])  # batch-invariant


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias, block: int):
    """What `gemm_w8a8.c` computes, in float64: each row quantized per token and per block of input
    channels (scale max|x| / 127 over the block), exact integer products per block, then the scales and
    the bias. Also the error one activation rounded the other way at a tie may add."""
    rows, k = x.shape
    kp = -(-k // block) * block
    xb = torch.nn.functional.pad(x, (0, kp - k)).view(rows, kp // block, block)
    qb = torch.nn.functional.pad(q, (0, kp - k)).view(q.shape[0], kp // block, block).double()
    amax = xb.abs().amax(dim=2, keepdim=True)
    xq = torch.where(amax > 0, torch.round(xb * (127 / amax.clamp_min(1e-30))), torch.zeros_like(xb))
    sums = torch.einsum("mbk,nbk->mbn", xq.double(), qb)
    ref = (sums * (amax.double() / 127)).sum(1) * scale.double() + (0 if bias is None else bias.double())
    return ref, (amax.double() / 127).amax(1) * scale.double() * 127


@pytest.mark.parametrize("out_features,in_features", [(1, 8), (17, 37), (100, 576), (3072, 64), (40, 150)])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 16, 33])
def test_w8a8_gemm_sums_int8_products_exactly(rows, out_features, in_features):
    """`--quantization w8a8_int8`: int8 weights in groups of k times int8 activations with a scale per
    token and block of input channels, summed in int32 and scaled once per block (every tile height,
    panels that end inside, K inside one block, across several and ending inside one, bias or not, a
    strided activation): equal to the integer products of the quantized operands, within int8's rounding
    of the float32 product, and the same bits for a row whatever the batch."""
    from common.layers.linear import PANEL, linear, pack_weight, quantize_int8

    g = torch.Generator().manual_seed(rows * 1000 + out_features + 2)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    packed = pack_weight(weight, quantization="w8a8_int8")
    group, block, weight_max, comp_lines = native.w8a8_layout()
    assert (group, block, weight_max) == (4, 64, 64)  # AVX2 and VNNI read the same weights
    lead = comp_lines * PANEL * 4  # AVX2: each block led by its weight sums
    panels, kp = -(-out_features // PANEL), -(-in_features // block) * block
    assert packed.int8_activations and packed.weight.dtype == torch.int8
    assert packed.weight.shape == (panels, kp // block, lead + PANEL * block)
    q, scale = quantize_int8(weight, weight_max)
    assert q.abs().max() == weight_max
    # each block of each panel: (AVX2) -128 x the block's sum of a column's weights (where the block's
    # sums start), then its weights, four steps of k for 16 columns a line
    first = packed.weight[0, 0]
    lines = first[lead:].view(block // group, PANEL, group)
    assert torch.equal(lines[0, :min(PANEL, out_features), 0], q[:PANEL, 0])
    if lead:
        head = torch.nn.functional.pad(q[:PANEL, :block].to(torch.int32), (0, max(0, block - in_features)))
        assert torch.equal(first[:lead].view(torch.int32)[:min(PANEL, out_features)], head.sum(1) * -128)
    for x, b, out in strided_outputs(rows, weight, packed, bias, g):
        if not rows:
            continue
        ref, step = w8a8_reference(x, q, scale, b, block)
        # the kernel's reciprocals may round an activation at a tie the other way: one step of one product
        assert ((out.double() - ref).abs() <= 1e-5 * ref.abs() + step + 1e-6).all()
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert (out.double() - exact).abs().max().item() < 0.1 * in_features ** 0.5
        assert torch.equal(linear(x[-1:], weight, packed, b), out[-1:])  # batch-invariant


def test_w8a8_gemm_gives_every_row_its_own_bits_in_any_batch():
    """The rows of a batch go in row blocks of heights that differ by at most one (64 rows: 6 and 5 on
    AVX2, 11 and 10 with VNNI), each quantized k-major eight floats at a time with a masked tail (203
    input channels: three whole blocks and one of 11); every row still gets the bits it gets alone, in a
    tensor of its own (nothing read past its last channel)."""
    from common.layers.linear import linear, pack_weight

    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(40, 203, generator=g), torch.randn(40, generator=g)
    x = torch.randn(64, 203, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    packed = pack_weight(weight, quantization="w8a8_int8")
    out = linear(x, weight, packed, bias)
    for rows in (13, 7):
        assert torch.equal(linear(x[:rows].clone(), weight, packed, bias), out[:rows])
    for m in range(64):
        assert torch.equal(linear(x[m:m + 1].clone(), weight, packed, bias), out[m:m + 1]), m


def test_w8a8_gemm_never_saturates_at_the_extremes():
    """Every weight at +-64 and every activation at +-127 (the quantizer's extremes), signs chosen so a
    run of products is as large as it gets in both directions: AVX2's byte multiply-add sums pairs of
    (x + 128) * w into int16, exact only while |pair| <= 32767; the result is the exact integer sum."""
    from common.layers.linear import linear, pack_weight, quantize_int8

    g = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (48, 256), generator=g).float() * 2 - 1
    weight = torch.cat([torch.ones(16, 256), -torch.ones(16, 256), signs[:16]])
    x = torch.cat([torch.ones(2, 256), -torch.ones(2, 256), signs[16:20]])
    packed = pack_weight(weight, quantization="w8a8_int8")
    q, scale = quantize_int8(weight, native.w8a8_layout()[2])
    assert q.abs().min() == 64
    ref, _ = w8a8_reference(x, q, scale, None, native.w8a8_layout()[1])
    assert torch.allclose(linear(x, weight, packed).double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ref, x.double() @ weight.double().T)


def test_w8a8_gemm_keeps_a_non_finite_row_to_itself():
    from common.layers.linear import linear, pack_weight

    weight, x = torch.randn(40, 24), torch.randn(3, 24)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    out = linear(x, weight, pack_weight(weight, quantization="w8a8_int8"))
    assert out[0].isfinite().all() and out[1:].isnan().all()
    # at the end of a block, in a later block, alone among zeros, and -inf
    weight, x = torch.randn(40, 200), torch.randn(6, 200)
    x[1, 63], x[2, 130], x[4, 199] = float("nan"), float("-inf"), float("inf")
    x[3], x[3, 70] = 0.0, float("nan")
    out = linear(x, weight, pack_weight(weight, quantization="w8a8_int8"))
    assert out[[0, 5]].isfinite().all() and out[1:5].isnan().all()


def test_int8_needs_the_panels(monkeypatch):
    from common.layers.linear import pack_weight

    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "onednn")
    with pytest.raises(ValueError, match="int8wo needs the native kernels"):
        pack_weight(torch.randn(8, 8), quantization="int8wo")
    with pytest.raises(ValueError, match="--quantization w8a8_int8 needs the native kernels"):
        pack_weight(torch.randn(8, 8), quantization="w8a8_int8")
    monkeypatch.delenv("PDSERVE_PACKED_LINEAR")
    with pytest.raises(ValueError, match="int4wo"):
        pack_weight(torch.randn(8, 8), quantization="int4wo")


def test_panel_gemm_keeps_leading_dims_and_uses_threads():
    from common.layers.linear import linear, pack_weight

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(3072, 576, generator=g)  # large enough for the OpenMP split over panels
    x = torch.randn(2, 8, 576, generator=g)
    out = linear(x, weight, pack_weight(weight))
    assert out.shape == (2, 8, 3072)
    assert torch.allclose(out, x @ weight.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("mode", ["onednn", "0"])
def test_linear_fallbacks(mode, monkeypatch):
    """`PDSERVE_PACKED_LINEAR=onednn` (what runs without the native GEMM) and `=0` (plain F.linear)."""
    from common.layers.linear import linear, pack_weight

    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", mode)
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    packed = pack_weight(weight)
    assert (packed is None) == (mode == "0")
    if packed is not None:
        assert isinstance(packed, torch.Tensor) and packed.dim() == 2  # oneDNN's layout, not panels
    x = torch.randn(6, 24, generator=g)
    assert torch.allclose(linear(x, weight, packed, bias), F.linear(x, weight, bias), atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 1536), (16, 13), (40, 1024)])  # 40 x 1024: the OpenMP path
def test_silu_and_mul_matches_torch(rows, n, monkeypatch):
    """Vector body and scalar tail, gates far out on both sides (e^-g clamps), a strided row."""
    import common.layers.activation as activation

    assert native.silu_and_mul() is not None
    g = torch.Generator().manual_seed(n)
    wide = torch.randn(rows, 2 * n + 5, generator=g) * 4
    wide[0, :4] = torch.tensor([-120.0, -90.0, 95.0, 0.0])
    gate_up = wide[:, :2 * n]
    ref = (F.silu(gate_up[:, :n].double()) * gate_up[:, n:].double())
    out = activation.silu_and_mul(gate_up)
    assert out.shape == (rows, n)

    def rel_err(x):  # relative, and absolute below 1 (a few float32 ulps)
        return ((x.double() - ref).abs() / ref.abs().clamp_min(1)).max().item()

    assert rel_err(out) < 1e-6
    monkeypatch.setattr(native, "silu_and_mul", lambda: None)
    assert rel_err(activation.silu_and_mul(gate_up)) < 1e-6


@pytest.mark.parametrize("quantization", [None, "int8wo"])
@pytest.mark.parametrize("rows", [1, 5, 13, 40, 300])  # 300 rows: many row blocks, the OpenMP path
def test_fused_gate_up_silu_gives_the_bits_of_the_matmul_then_silu(quantization, rows):
    """`packed_gemm_silu`: the MLP's [gate | up] matmul and SiLU-and-mul in one pass equal, bit for bit, the
    matmul into [rows, 2n] followed by `silu_and_mul` (float32 and int8 panels, with and without a bias, a
    strided activation and output); a width that is not a multiple of its tiles is refused (-3)."""
    from common.layers.linear import linear, pack_weight

    fused, step = native.packed_gemm_silu(), native.packed_gemm_silu_cols()
    assert fused is not None and step in (16, 32)
    g = torch.Generator().manual_seed(rows)
    n, k = 3 * step, 150
    weight = torch.randn(2 * n, k, generator=g) / 8
    bias = torch.randn(2 * n, generator=g)
    packed = pack_weight(weight, quantization=quantization) if quantization else pack_weight(weight)
    x = torch.randn(rows, k + 7, generator=g)[:, 2:2 + k]
    scale = packed.scale.data_ptr() if packed.scale is not None else None
    for b in (None, bias):
        act = torch.full((rows, n + 5), float("nan"))
        rc = fused(x.data_ptr(), x.stride(0), packed.weight.data_ptr(), scale,
                   None if b is None else b.data_ptr(), act.data_ptr(), act.stride(0), rows, n, k)
        assert rc == 0
        want = native.silu_and_mul()
        gate_up = linear(x, weight, packed, b)
        ref = torch.empty(rows, n)
        want(gate_up.data_ptr(), gate_up.stride(0), ref.data_ptr(), rows, n)
        assert torch.equal(act[:, :n], ref)
        assert act[:, n:].isnan().all()  # nothing written past the row's n columns
    odd = torch.zeros(rows, n)
    assert fused(x.data_ptr(), x.stride(0), packed.weight.data_ptr(), scale, None, odd.data_ptr(), n, rows,
                 n - step // 2, k) == -3


def test_argmax_matches_torch():
    """Ties (first index wins), the maximum in the vector body or the scalar tail, -inf rows, NaNs
    (the first NaN wins, in the body or in the tail), a row stride."""
    from common.layers.sampling import argmax

    assert native.argmax_rows() is not None
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(12, 1003 + 4, generator=g)
    x = wide[:, :1003]
    x[1, 7] = x[1, 900] = 50.0  # tie: 7
    x[2, 1001] = 60.0  # in the tail
    x[3] = float("-inf")
    x[4, 500] = float("nan")
    x[4, 600] = float("nan")
    x[5, 1002] = float("nan")  # NaN only in the tail
    x[5, 3] = 99.0
    x[6, :] = 1.0  # all equal
    out = argmax(x)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.argmax(x, dim=-1))
    assert out[:7].tolist()[1:] == [7, 1001, 0, 500, 1002, 0]
    big = torch.randn(40, 49152, generator=g)  # the OpenMP path
    assert torch.equal(argmax(big), torch.argmax(big, dim=-1))


@pytest.mark.parametrize("n,prefix", [(300, 0), (50, 200), (1, 7)])
def test_prefill_attention_matches_float64(n, prefix):
    """`prefill_attention.c` on every thread torch has: row i sees keys 0..prefix + i (GQA 3 of 9 heads)."""
    kernel = native.prefill_attention()
    if kernel is None:
        pytest.skip("no native prefill attention in this build")
    fn = kernel[0]
    heads, group, d = 9, 3, 64
    g = torch.Generator().manual_seed(n + prefix)
    q = torch.randn(n, heads * d + 5, generator=g)[:, :heads * d]
    # K and V with token strides of their own (views into wider rows, as a projection's output is read)
    k = torch.randn(prefix + n, heads // group + 1, d, generator=g)[:, 1:]
    v = torch.randn(prefix + n, heads // group + 2, d, generator=g)[:, :heads // group]
    out = torch.empty(n, heads * d)
    assert fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), d, n,
              prefix, heads, group, d, d ** -0.5, out.data_ptr(), out.stride(0)) == 0
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("nhd,shd->hns", q.double().view(n, heads, d), kk) * d ** -0.5
    allowed = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]
    ref = torch.einsum("hns,shd->nhd",
                       scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv).reshape(n, -1)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_fma_peak_is_above_what_the_panel_matmul_reaches():
    """The FMA rate the benches hold a prefill against (`fma_peak.c`, through bench/host_peaks.py): one
    thread's, from registers alone, must not fall below what the panel matmul (a tile's FMAs plus its loads)
    reaches on that thread; nor pass 64 FLOPs a cycle at 6 GHz (chains the compiler merged)."""
    from common.layers import native
    from common.layers.linear import linear, pack_weight

    fma = native.fma_peak_gflops()
    assert fma is not None
    peak = max(fma(2_000_000, 1) for _ in range(5))
    assert 1 < peak < 64 * 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(3)
        weight = torch.randn(512, 576, generator=g)
        packed = pack_weight(weight)
        x = torch.randn(240, 576, generator=g)
        linear(x, weight, packed, None)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            linear(x, weight, packed, None)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    assert 2 * 240 * 576 * 512 / best / 1e9 < 1.25 * peak
