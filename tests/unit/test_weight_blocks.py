"""Float32 weights kept as their checkpoint's blocks of 32 (`common/layers/weight_blocks.py`,
`gemm_blocks.c`): the matmul over the blocks gives the float32 panels' bits, only exact blocks are taken,
and a model whose weights are a GGUF file's gives Hugging Face's logits and the float32 panels' bits."""

from __future__ import annotations

import pytest
import torch

from common.layers import native
from common.layers.linear import Panels, pack_weight
from common.layers.weight_blocks import find_blocks
from common.models.loader import load_model
from common.models.tiny_model import gguf_round_trip
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)
from tests.unit.test_model_vs_hf import check_model, prompt

pytestmark = pytest.mark.skipif(native.packed_gemm() is None, reason="no native GEMM on this machine")


def _matmul_both(weight: torch.Tensor, rows: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = weight.shape
    packed = pack_weight(weight)
    assert packed.blocks is not None
    x = torch.randn(rows, inp + 3)[:, 1:inp + 1]  # rows with a stride of their own
    b = torch.randn(out) if bias else None
    ys = [torch.full((rows, out + 5), 7.0) for _ in range(2)]
    args = (x.data_ptr(), x.stride(0))
    tail = (None if b is None else b.data_ptr(),)
    assert native.packed_gemm()(*args, packed.weight.data_ptr(), *tail, ys[0].data_ptr(),
                                out + 5, rows, out, inp) == 0
    assert native.packed_gemm_blocks()(*args, packed.blocks.packed.data_ptr(), packed.blocks.bits, *tail,
                                       ys[1].data_ptr(), out + 5, rows, out, inp) == 0
    return ys[0], ys[1]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(50, 64), (960, 576), (24, 1536), (576, 64), (117, 96)])
def test_block_gemm_gives_the_float32_panels_bits(bits, shape):
    """Every row count (one tile of 1-5 rows, several row blocks), tiles narrower than the widest and tiles
    across two groups of panels (36 panels: each thread's 18 as 4 + 4 + 4 + 3 + 3), a last panel cut short,
    columns past N untouched, with and without a bias; on one thread and on two."""
    torch.manual_seed(bits)
    weight = gguf_round_trip(torch.randn(*shape) * 0.05, bits)
    for threads in (1, 2):  # each thread an even share of the panels (the fixture restores the count)
        torch.set_num_threads(threads)
        for rows in (1, 2, 3, 4, 5, 6, 9, 17):
            for bias in (False, True):
                y32, yb = _matmul_both(weight, rows, bias)
                assert torch.equal(y32.view(torch.int32), yb.view(torch.int32)), (threads, rows, bias)
                assert torch.all(yb[:, shape[0]:] == 7.0)


def test_block_gemm_refuses_what_it_cannot_read():
    x, y = torch.randn(2, 48), torch.empty(2, 16)
    w = torch.zeros(4096, dtype=torch.uint8)
    gemm = native.packed_gemm_blocks()
    assert gemm(x.data_ptr(), 48, w.data_ptr(), 4, None, y.data_ptr(), 16, 2, 16, 48) == -2  # K % 32
    assert gemm(x.data_ptr(), 32, w.data_ptr(), 5, None, y.data_ptr(), 16, 2, 16, 32) == -2  # bits


def reference_blocks(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_weight_blocks` written with torch ops, as weight_blocks.py computed it before the C pass: the
    split into (q, d, m) of each row's blocks of 32, then `gemm_blocks.c`'s layout of 16-row panels in
    groups of 4."""
    out, inp = weight.shape
    v = weight.view(out, inp // 32, 32)
    if bits == 4:
        m = v.amin(-1, keepdim=True)
        d = ((v.amax(-1, keepdim=True) - m) / 15).half().float()
        lo, hi = 0, 15
    else:
        m = None
        d = (v.abs().amax(-1, keepdim=True) / 127).half().float()
        lo, hi = -127, 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((v if m is None else v - m) / safe).clamp_(lo, hi).to(torch.int16)
    d = d.squeeze(-1)
    m = None if m is None else m.squeeze(-1)
    panels, nb = -(-out // 16), inp // 32
    pad = panels * 16 - out
    q = torch.cat([q, q.new_zeros(pad, nb, 32)])
    d = torch.cat([d, d.new_zeros(pad, nb)])
    m = None if m is None else torch.cat([m, m.new_zeros(pad, nb)])

    def per_block(t):  # [panels * 16, nb] -> [panels, nb, 32] bytes (float16)
        return t.half().view(panels, 16, nb).transpose(1, 2).contiguous().view(torch.uint8)

    qk = q.view(panels, 16, nb, 32).permute(0, 2, 3, 1)  # [panels, nb, k, column]
    if bits == 4:
        scales = torch.cat([per_block(d), per_block(m)], dim=2)
        steps = (qk[:, :, 0::2] | (qk[:, :, 1::2] << 4)).to(torch.uint8)  # [panels, nb, k / 2, 16]
    else:
        scales = per_block(d)
        steps = qk.to(torch.int8).contiguous().view(torch.uint8)  # [panels, nb, k, 16]
    # by groups of 4 panels (the last may be smaller): per block, the group's scales, then per line (a pair of
    # steps of k with 4 bits, a step with 8) the group's bytes of that line
    groups = []
    for g in range(0, panels, 4):
        s, t = scales[g:g + 4], steps[g:g + 4]
        groups.append(torch.cat([s.transpose(0, 1).reshape(nb, -1), t.permute(1, 2, 0, 3).reshape(nb, -1)],
                                dim=1).reshape(-1))
    return torch.cat(groups)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_one_pass_packing_gives_the_reference_bytes(bits):
    """Exact blocks, plain float32 (refused later, packed alike all the same), zero and constant blocks,
    and rows that do not fill the last panel."""
    torch.manual_seed(bits)
    for weight in (gguf_round_trip(torch.randn(40, 96) * 0.05, bits), torch.randn(33, 64),
                   torch.zeros(16, 32), torch.full((5, 64), -0.25),
                   gguf_round_trip(torch.randn(960, 576), bits)):
        out, inp = weight.shape
        want = reference_blocks(weight, bits)
        got = torch.full_like(want, 0xAB)
        native.pack_weight_blocks()(bits, weight.data_ptr(), out, inp, got.data_ptr())
        assert torch.equal(got, want), (bits, tuple(weight.shape))


def blocks_of(weight: torch.Tensor):
    """What `find_blocks` gave the packed weight (None: float32 panels only, or not packed as panels)."""
    packed = pack_weight(weight)
    return packed.blocks if isinstance(packed, Panels) else None


def test_find_blocks_takes_only_exact_blocks(monkeypatch):
    torch.manual_seed(0)
    q4 = gguf_round_trip(torch.randn(40, 64), 4)
    q8 = gguf_round_trip(torch.randn(40, 64), 8)
    assert blocks_of(q4).bits == 4 and blocks_of(q8).bits == 8
    assert blocks_of(torch.randn(40, 64)) is None  # plain float32
    nudged = q4.clone()
    # one weight off by one ulp, past the sample
    nudged[33, 7] = torch.nextafter(nudged[33, 7], torch.tensor(1.0))
    assert blocks_of(nudged) is None
    signed_zero = q8.clone()
    signed_zero[39, 63] = -0.0  # -0.0 and +0.0 give different bits in some sums: not taken
    assert blocks_of(signed_zero) is None
    assert blocks_of(gguf_round_trip(torch.randn(40, 64), 4)[:, :48]) is None  # in not a multiple of 32
    # float64 is refused by find_blocks itself (pack_weight would not pack it as panels at all)
    assert find_blocks(q4.double(), pack_weight(q4).weight) is None
    monkeypatch.setenv("PDSERVE_WEIGHT_BLOCKS", "0")
    assert blocks_of(q4) is None


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_weights_match_hf_and_the_float32_panels(make_tiny_model, monkeypatch, tied):
    """Projections as Q4_1 and the embedding / lm_head as Q8_0: every packed matmul finds its blocks; the
    model stays within the HF tolerance (extend, chunked extend, decode, batches); and decode batches of 1-6
    requests through the blocks give the same logits, bit for bit, as with the blocks turned off."""
    model_dir = make_tiny_model("llama", gguf_blocks=True, tie_word_embeddings=tied)
    check_model(model_dir, page_size=4)

    model, cfg = load_model(model_dir)
    packed = [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), Panels)]
    if tied:
        packed.append(model.lm_head_packed)
    assert packed and all(p.blocks is not None for p in packed)
    assert {p.blocks.bits for p in packed} == {4, 8}
    monkeypatch.setenv("PDSERVE_WEIGHT_BLOCKS", "0")
    plain, _ = load_model(model_dir)
    assert all(m.packed.blocks is None for m in plain.modules()
               if isinstance(getattr(m, "packed", None), Panels))

    ids = prompt(40, vocab=cfg.vocab_size)
    for batch in (1, 2, 5, 6):
        outs = []
        for m in (model, plain):
            h = Harness.for_model(cfg, page_size=4, scramble_seed=batch)
            rows = [h.new_req() for _ in range(batch)]
            m(h.extend_batch([(r, ids[i:i + 9]) for i, r in enumerate(rows)]))
            steps = [m(h.decode_batch([(r, ids[9 + i + s]) for i, r in enumerate(rows)])) for s in range(4)]
            outs.append(torch.stack(steps))
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), batch


def test_small_matmuls_read_the_blocks_up_to_a_row_count_that_depends_on_the_build_and_threads():
    """AVX-512 tiles widen a panel in one register: 12 rows whatever the threads; AVX2's, 8 rows on two
    threads and 5 on one."""
    n = torch.get_num_threads()
    avx512 = "-mavx512f" in native._compile_flags()
    try:
        torch.set_num_threads(1)
        assert native.block_rows() == (12 if avx512 else 5)
        torch.set_num_threads(2)
        assert native.block_rows() == (12 if avx512 else 8)
    finally:
        torch.set_num_threads(n)

