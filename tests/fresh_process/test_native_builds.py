"""The native kernels built a second way, for AVX2 alone, give the bits of this machine's AVX-512 build
(common/layers/native.py compiles the library with the C compiler, a process of its own). Each kernel
against torch: tests/unit/test_native_kernels.py."""

from __future__ import annotations

import pytest
import torch

from common.layers import native


def test_avx512_and_avx2_builds_give_the_same_bits(tmp_path, monkeypatch):
    """Where the CPU has AVX-512 the GEMM tile is one or two 16-column panels of one register each
    (gemm.c); each output still gets the same fused multiply-adds in the same order as the AVX2 tile, so
    a prefill node and a decode node on different CPUs agree (pairs of panels, a last panel alone, the
    second of a pair cut short, one and two row blocks below). The w8a8 GEMM sums exact integers either
    way (VNNI's byte dot products or AVX2's byte pairs, gemm_w8a8.c), from the same weights. Built here
    both ways and compared bit for bit."""
    import ctypes

    from common.layers.linear import pack_weight, quantize_int8, w8a8_panels

    if "avx512f" not in native._cpu_flags() or native.packed_gemm() is None:
        pytest.skip("this CPU has no AVX-512: only the AVX2 build exists here")
    default = native._library()
    monkeypatch.setenv("PDSERVE_NATIVE_ISA", "avx2")  # what an AVX2-only host builds
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert not any(f.startswith("-mavx512") for f in native._compile_flags())
    avx2 = ctypes.CDLL(str(native.build()))
    assert avx2.packed_gemm_w8a8_group() == default.packed_gemm_w8a8_group() == 4  # the same weights,
    assert avx2.packed_gemm_w8a8_comp_lines() == 1  # led by their sums with AVX2
    g = torch.Generator().manual_seed(11)
    for rows, out, inp in ((1, 100, 576), (16, 1536, 64), (37, 49, 200), (13, 81, 96), (7, 32, 128)):
        w, b = torch.randn(out, inp, generator=g), torch.randn(out, generator=g)
        x = torch.randn(rows, inp, generator=g)
        if inp == 128:  # the w8a8 extremes: weights at +-64 and activations at +-127 (no saturation)
            w, x = w.sign(), x.sign()
        for quant in (None, "int8wo", "w8a8_int8"):
            p = pack_weight(w, quantization=quant)
            ys = []
            for lib in (avx2, default):
                y = torch.empty(rows, out)
                weight = p.weight
                if quant == "w8a8_int8":  # each build its own panels (AVX2's blocks lead with their sums)
                    layout = native.library_w8a8_layout(lib)
                    weight = w8a8_panels(quantize_int8(w, layout[2])[0], layout)
                args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(inp),
                        ctypes.c_void_p(weight.data_ptr())]
                if quant:
                    args.append(ctypes.c_void_p(p.scale.data_ptr()))
                args += [ctypes.c_void_p(b.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(out),
                         ctypes.c_int64(rows), ctypes.c_int64(out), ctypes.c_int64(inp)]
                gemm = {None: lib.packed_gemm, "int8wo": lib.packed_gemm_i8,
                        "w8a8_int8": lib.packed_gemm_w8a8}
                gemm[quant](*args)
                ys.append(y)
            assert torch.equal(ys[0], ys[1]), (rows, out, inp, quant)
    # causal prefill attention: the same FMAs and exp in either build (AVX2: tiles one vector wide)
    assert avx2.prefill_attention_block() == 16 and default.prefill_attention_block() == 32
    for n, prefix, heads, group, d in ((40, 0, 6, 3, 64), (13, 21, 4, 1, 32)):
        q = torch.randn(n, heads * d, generator=g)
        k, v = (torch.randn(prefix + n, heads // group, d, generator=g) for _ in range(2))
        ys = []
        for lib in (avx2, default):
            y = torch.empty(n, heads * d)
            args = (q, ctypes.c_int64(heads * d), k, ctypes.c_int64(k.stride(0)), v,
                    ctypes.c_int64(v.stride(0)), ctypes.c_int64(d),
                    ctypes.c_int64(n), ctypes.c_int64(prefix), ctypes.c_int64(heads), ctypes.c_int64(group),
                    ctypes.c_int64(d), ctypes.c_float(d ** -0.5), y, ctypes.c_int64(heads * d))
            pointers = [ctypes.c_void_p(t.data_ptr()) if isinstance(t, torch.Tensor) else t for t in args]
            assert lib.prefill_attention(*pointers) == 0
            ys.append(y)
        assert torch.equal(ys[0], ys[1]), (n, prefix, heads, group, d)
    # SiLU-and-mul: sixteen lanes of exp16 with AVX-512, eight of exp8 with AVX2, one expf past them
    gate_up = torch.randn(5, 2 * 1547, generator=g) * 6
    ys = []
    for lib in (avx2, default):
        y = torch.empty(5, 1547)
        lib.silu_and_mul(ctypes.c_void_p(gate_up.data_ptr()), ctypes.c_int64(2 * 1547),
                         ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(5), ctypes.c_int64(1547))
        ys.append(y)
    assert torch.equal(ys[0], ys[1])
    # a checkpoint's 4- and 8-bit blocks (gemm_blocks.c: the same layout in either build; AVX-512 widens a
    # panel's 16 columns in one register, and both steps of a 4-bit line from one byte-to-dword move)
    from common.models.tiny_model import gguf_round_trip

    for bits in (4, 8):
        w = gguf_round_trip(torch.randn(117, 96, generator=g) * 0.05, bits)
        blocks = pack_weight(w).blocks
        assert blocks is not None and blocks.bits == bits
        b = torch.randn(117, generator=g)
        for rows in (1, 2, 3, 7):
            x = torch.randn(rows, 96, generator=g)
            ys = []
            for lib in (avx2, default):
                y = torch.empty(rows, 117)
                assert lib.packed_gemm_blocks(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(96),
                                              ctypes.c_void_p(blocks.packed.data_ptr()), ctypes.c_int64(bits),
                                              ctypes.c_void_p(b.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                              ctypes.c_int64(117), ctypes.c_int64(rows), ctypes.c_int64(117),
                                              ctypes.c_int64(96)) == 0
                ys.append(y)
            assert torch.equal(ys[0], ys[1]), (bits, rows)
    # the fused gate-up-SiLU: AVX2 tiles of one panel, AVX-512 of two, the same products and SiLU
    assert avx2.packed_gemm_silu_cols() == 16 and default.packed_gemm_silu_cols() == 32
    n, inp = 96, 200
    w, b = torch.randn(2 * n, inp, generator=g), torch.randn(2 * n, generator=g)
    for rows in (1, 13, 40):
        x = torch.randn(rows, inp, generator=g)
        for quant in (None, "int8wo"):
            p = pack_weight(w, quantization=quant)
            ys = []
            for lib in (avx2, default):
                y = torch.empty(rows, n)
                scale = ctypes.c_void_p(p.scale.data_ptr() if quant else None)
                assert lib.packed_gemm_silu(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(inp),
                                            ctypes.c_void_p(p.weight.data_ptr()), scale,
                                            ctypes.c_void_p(b.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                            ctypes.c_int64(n), ctypes.c_int64(rows), ctypes.c_int64(n),
                                            ctypes.c_int64(inp)) == 0
                ys.append(y)
            assert torch.equal(ys[0], ys[1]), (rows, quant)
