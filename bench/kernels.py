"""`pdserve bench kernels`: this checkout's panel GEMMs (`common/layers/gemm.c`, float32 and int8-weight;
`gemm_w8a8.c`, int8 weights and activations) and causal prefill attention
(`common/layers/prefill_attention.c`) against the same kernels built from
another git revision (`--baseline`), in one process, on SmolLM2-135M's shapes: both libraries are loaded
side by side and every timed call of one is followed by the same call of the other (in alternating
order), so the host's drifts hit both alike.

Ratios (higher is better): `fp32_r{rows}`, `int8_r{rows}` and `w8a8_r{rows}` = the baseline's median time /
ours (w8a8 only where the baseline reads the same w8a8 panels), summed
over the projection shapes, at each row count of `--rows` (1 and 16: decode batches; 64 and 512: prefill
chunks). `q4_r{rows}` and `q8_r{rows}`: weights rounded as a GGUF file's Q4_1 / Q8_0 (`gguf_round_trip`),
ours read as their blocks (`gemm_blocks.c`, whatever the row count), the baseline's as float32 panels. One
layer's weights (14 MB in float32) stay in this host's 32 MB L3 between calls; `--layers 30`
gives each shape 30 copies, one per layer as in SmolLM2, and a timed call runs them all, so the weights
stream from DRAM as they do in a decode step. `attn_r{rows}`: the same for one sequence's prefill
attention of that many tokens (row counts of 16 and more), and `attn_torch_r{rows}` = torch's
`scaled_dot_product_attention` (its CPU flash kernel, timed in the same alternation) / ours. Figures: each
side's milliseconds and whether both gave the same bits (`same_bits`).

`w8a8_vs_fp32_r{rows}`: this checkout's float32 GEMM time / its w8a8 GEMM time on the same shapes and
rows, the two timed in one alternation of their own: how much faster int8 arithmetic does the same
matmul (the prefill's gain from `--quantization w8a8_int8`). `--isa avx2` builds both libraries for AVX2
and FMA alone (`PDSERVE_NATIVE_ISA=avx2`), so a host with AVX-512 measures the kernels an AVX2-only host
runs.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.report import HelpFormatter, write_report
from common.layers import native
from common.layers.linear import pack_weight, quantize_int8, w8a8_panels
from common.models.tiny_model import gguf_round_trip

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's projections, [out, in]: qkv, o, gate+up, down
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # its attention


def log(msg: str) -> None:
    print(f"[bench kernels {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--baseline", default="HEAD", help="git revision whose kernels are the reference")
    p.add_argument("--rows", default="1,16,64,512", help="row counts (tokens per matmul) measured")
    p.add_argument("--calls", type=int, default=40, help="timed calls per side, shape and row count")
    p.add_argument("--layers", type=int, default=1,
                   help="copies of each shape's weights a timed call runs through (30: SmolLM2's layers, "
                        "the weights then come from DRAM as in a decode step)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--isa", choices=("native", "avx2"), default="native",
                   help="instruction set both libraries are built for: this CPU's, or AVX2 and FMA alone")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def baseline_library(rev: str) -> Path:
    """The kernels of revision `rev`, built into the cache (reused when the sources are this checkout's)."""
    with tempfile.TemporaryDirectory() as d:
        for f in native.SOURCES + native.HEADERS:
            rel = f.relative_to(ROOT).as_posix()
            out = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True)
            if out.returncode != 0 and b"exists on disk, but not in" in out.stderr:
                continue  # a kernel file newer than `rev`: its library is built without it
            if out.returncode != 0:
                raise SystemExit(f"--baseline {rev}: cannot read {rel}: {out.stderr.decode().strip()}")
            (Path(d) / f.name).write_bytes(out.stdout)
        return native.build(Path(d))


def _gemm(lib: ctypes.CDLL, scheme: str):
    name = {"int8": "packed_gemm_i8", "w8a8": "packed_gemm_w8a8", "blocks": "packed_gemm_blocks"}.get(scheme,
                                                                                                  "packed_gemm")
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = native._SIGNATURES[name]  # the signatures the engine loads them with
    return fn


def _gemm_call(fn, heads: list[list], y: torch.Tensor, out: int, rows: int, inp: int) -> None:
    for head in heads:  # one layer's weights after another
        if fn(*head, None, y.data_ptr(), out, rows, out, inp):
            raise MemoryError("panel matmul: no memory for the packed activations")


def _alternate(calls: int, fns: list) -> list[float]:
    """Each side's median seconds over `calls` timed calls (after two warm-ups), the order alternating."""
    times: list[list[float]] = [[] for _ in fns]
    for c in range(calls + 2):
        for side in (range(len(fns)) if c % 2 == 0 else reversed(range(len(fns)))):
            t = time.perf_counter()
            fns[side]()
            if c >= 2:
                times[side].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


# a build before K and V had token strides of their own took one for both
_ONE_KV_STRIDE = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7 \
    + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]


def _attention_call(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    rows, d = q.shape[0], HEAD_DIM
    strides = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)) if fn.kv_strides \
        else (k.data_ptr(), v.data_ptr(), k.stride(0))
    if fn(q.data_ptr(), q.stride(0), *strides, d, rows, 0, HEADS,
          HEADS // KV_HEADS, d, d ** -0.5, out.data_ptr(), out.stride(0)):
        raise MemoryError("prefill attention: no memory")


def _attention(libs: list[ctypes.CDLL], rows: int, calls: int) -> tuple[list[float], bool]:
    """Medians of ours, the baseline's and torch's causal attention over `rows` new tokens (no prefix)."""
    fns = [lib.prefill_attention for lib in libs]
    for lib, fn in zip(libs, fns, strict=True):
        fn.kv_strides = hasattr(lib, "prefill_attention_kv_strides")
        fn.argtypes = native._SIGNATURES["prefill_attention"][0] if fn.kv_strides else _ONE_KV_STRIDE
        fn.restype = ctypes.c_int
    h, d = HEADS, HEAD_DIM
    # views into one q/k/v projection's output, as the model passes them (a token's row 960 floats long)
    qkv = torch.randn(rows, (h + 2 * KV_HEADS) * d)
    q, k, v = qkv.split([h * d, KV_HEADS * d, KV_HEADS * d], dim=1)
    outs = [torch.empty(rows, h * d) for _ in fns]
    qt = q.view(rows, h, d).transpose(0, 1).unsqueeze(0)
    kt, vt = (x.view(rows, KV_HEADS, d).transpose(0, 1).unsqueeze(0) for x in (k, v))
    flash = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=True,
                              scale=d ** -0.5, enable_gqa=True)
    ours_and_base = [functools.partial(_attention_call, fn, q, k, v, o)
                     for fn, o in zip(fns, outs, strict=True)]
    medians = _alternate(calls, ours_and_base + [flash])
    return medians, torch.equal(outs[0], outs[1])


def _pack(w: torch.Tensor, quantization: str | None, lib: ctypes.CDLL):
    """`pack_weight`, with w8a8's panels in the layout `lib` reads (the process's own library may have been
    built for another instruction set: an AVX2 build's blocks lead with their weight sums, VNNI's not)."""
    packed = pack_weight(w, quantization=quantization)
    if quantization != "w8a8_int8":
        return packed
    layout = native.library_w8a8_layout(lib)
    return replace(packed, weight=w8a8_panels(quantize_int8(w, layout[2])[0], layout))


def _panel_args(x: torch.Tensor, layers: list) -> list[list]:
    """Each layer's leading arguments of a panel GEMM call: x, its stride, the panels, their scales."""
    return [[x.data_ptr(), x.stride(0), p.weight.data_ptr()]
            + ([p.scale.data_ptr()] if p.scale is not None else []) for p in layers]


def _w8a8_vs_fp32(lib: ctypes.CDLL, rows_list: list[int], args, figures: dict, ratios: dict) -> None:
    """This library's float32 GEMM against its w8a8 GEMM on the same weights and activations."""
    fns = [_gemm(lib, "fp32"), _gemm(lib, "w8a8")]
    weights = [[torch.randn(out, inp) * 0.02 for _ in range(args.layers)] for out, inp in SHAPES]
    packs = [[[_pack(w, q, lib) for w in layers] for layers in weights] for q in (None, "w8a8_int8")]
    for rows in rows_list:
        total = [0.0, 0.0]
        for s, (out, inp) in enumerate(SHAPES):
            x = torch.randn(rows, inp)
            ys = [torch.empty(rows, out), torch.empty(rows, out)]
            calls = [functools.partial(_gemm_call, fns[side], _panel_args(x, packs[side][s]), ys[side], out,
                                       rows, inp) for side in (0, 1)]
            for side, m in enumerate(_alternate(args.calls, calls)):
                total[side] += m
            error = ((ys[1] - ys[0]).norm() / ys[0].norm()).item()
            if not error < 0.05:
                raise SystemExit(f"w8a8 against float32, {rows} rows, {out}x{inp}: relative error {error}")
        ratios[f"w8a8_vs_fp32_r{rows}"] = total[0] / total[1]
        figures[f"w8a8_vs_fp32_r{rows}"] = {"fp32_ms": round(total[0] * 1e3, 4),
                                            "w8a8_ms": round(total[1] * 1e3, 4)}
        log(f"w8a8 against float32, {rows:4d} rows: float32 {total[0] * 1e3:8.3f} ms, w8a8 "
            f"{total[1] * 1e3:8.3f} ms ({total[0] / total[1]:.3f}x)")


def _same_w8a8_layout(libs: list[ctypes.CDLL]) -> bool:
    """Whether the baseline reads the w8a8 panels this checkout packs: both libraries give the same bits
    for a small matmul of them (an older kernel reads another grouping of k, or other block sums)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(20, 130, generator=g), torch.randn(3, 130, generator=g)
    packed = _pack(w, "w8a8_int8", libs[0])
    ys = [torch.empty(3, 20), torch.empty(3, 20)]
    for lib, y in zip(libs, ys, strict=True):
        if _gemm(lib, "w8a8")(*_panel_args(x, [packed])[0], None, y.data_ptr(), 20, 3, 20, 130):
            raise MemoryError("panel matmul: no memory for the packed activations")
    return torch.equal(ys[0], ys[1])


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.layers < 1:
        raise SystemExit("--layers must be >= 1")
    isa_before = os.environ.get("PDSERVE_NATIVE_ISA")
    os.environ["PDSERVE_NATIVE_ISA"] = args.isa  # for both builds and this report's machine line
    try:
        return _run(args, rows_list)
    finally:
        if isa_before is None:
            os.environ.pop("PDSERVE_NATIVE_ISA", None)
        else:
            os.environ["PDSERVE_NATIVE_ISA"] = isa_before


def _run(args, rows_list: list[int]):
    ours_path, base_path = native.build(), baseline_library(args.baseline)
    log(f"ours {ours_path.name}, baseline {args.baseline} {base_path.name}, {args.isa} build, "
        f"{torch.get_num_threads()} threads, {args.layers} layer(s) of weights per call")
    libs = [ctypes.CDLL(str(ours_path)), ctypes.CDLL(str(base_path))]
    torch.manual_seed(0)
    figures: dict = {"baseline": args.baseline, "shapes": [list(s) for s in SHAPES], "layers": args.layers,
                     "isa": args.isa, "w8a8_group": libs[0].packed_gemm_w8a8_group()}
    ratios: dict[str, float] = {}
    schemes = ["fp32", "int8", "w8a8", "q4", "q8"]
    if not _same_w8a8_layout(libs):
        schemes.remove("w8a8")
        figures["w8a8_baseline"] = "skipped: the baseline reads another w8a8 layout"
        log(f"w8a8: {args.baseline} reads another w8a8 layout; only w8a8_vs_fp32 is measured")
    for scheme in schemes:
        blocks = scheme in ("q4", "q8")
        # q4 / q8: ours reads the weights' blocks, the baseline its float32 panels of the same weights
        fns = [_gemm(libs[0], "blocks" if blocks else scheme), _gemm(libs[1], "fp32" if blocks else scheme)]
        quantization = {"int8": "int8wo", "w8a8": "w8a8_int8"}.get(scheme)
        make = {"q4": lambda w: gguf_round_trip(w, 4),
                "q8": lambda w: gguf_round_trip(w, 8)}.get(scheme, lambda w: w)
        packs = [[_pack(make(torch.randn(out, inp) * 0.02), quantization, libs[0])
                  for _ in range(args.layers)] for out, inp in SHAPES]
        for rows in rows_list:
            total, same = [0.0, 0.0], True
            for (out, inp), layers in zip(SHAPES, packs, strict=True):
                x = torch.randn(rows, inp)
                ys = [torch.empty(rows, out), torch.empty(rows, out)]
                panels = _panel_args(x, layers)
                ours = [[x.data_ptr(), x.stride(0), p.blocks.packed.data_ptr(), p.blocks.bits]
                        for p in layers] if blocks else panels
                heads = [ours, panels]
                calls = [functools.partial(_gemm_call, fns[side], heads[side], ys[side], out, rows, inp)
                         for side in (0, 1)]
                medians = _alternate(args.calls, calls)
                same = same and torch.equal(ys[0], ys[1])
                for side in (0, 1):
                    total[side] += medians[side]
            ratios[f"{scheme}_r{rows}"] = total[1] / total[0]
            figures[f"{scheme}_r{rows}"] = {"ours_ms": round(total[0] * 1e3, 4),
                                            "baseline_ms": round(total[1] * 1e3, 4), "same_bits": same}
            log(f"{scheme} {rows:4d} rows: ours {total[0] * 1e3:8.3f} ms, baseline {total[1] * 1e3:8.3f} ms "
                f"({total[1] / total[0]:.3f}x), same bits: {same}")
    _w8a8_vs_fp32(libs[0], rows_list, args, figures, ratios)
    for rows in (r for r in rows_list if r >= 16):
        (ours, base, flash), same = _attention(libs, rows, args.calls)
        ratios[f"attn_r{rows}"], ratios[f"attn_torch_r{rows}"] = base / ours, flash / ours
        figures[f"attn_r{rows}"] = {"ours_ms": round(ours * 1e3, 4), "baseline_ms": round(base * 1e3, 4),
                                    "torch_ms": round(flash * 1e3, 4), "same_bits": same}
        log(f"attention {rows:4d} tokens: ours {ours * 1e3:8.3f} ms, baseline {base * 1e3:8.3f} ms "
            f"({base / ours:.3f}x), torch {flash * 1e3:8.3f} ms ({flash / ours:.3f}x), same bits: {same}")
    return write_report(args.json, "kernels", figures, ratios)


if __name__ == "__main__":
    main()
