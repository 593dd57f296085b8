"""`pdserve bench kernels`: this checkout's panel GEMMs (`common/layers/gemm.c`, float32 and int8-weight)
against the same kernels built from another git revision (`--baseline`), in one process, on
SmolLM2-135M's projection shapes: both libraries are loaded side by side and every timed call of one
is followed by the same call of the other (in alternating order), so the host's drifts hit both alike.

Ratios (higher is better): `fp32_r{rows}` and `int8_r{rows}` = the baseline's median time / ours, summed
over the shapes, at each row count of `--rows` (1 and 16: decode batches; 64 and 512: prefill chunks).
Figures: each side's milliseconds and whether both gave the same bits (`same_bits`).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import HelpFormatter, write_report
from common.layers import native
from common.layers.linear import pack_weight

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's projections, [out, in]: qkv, o, gate+up, down
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))



def log(msg: str) -> None:
    print(f"[bench kernels {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--baseline", default="HEAD", help="git revision whose kernels are the reference")
    p.add_argument("--rows", default="1,16,64,512", help="row counts (tokens per matmul) measured")
    p.add_argument("--calls", type=int, default=40, help="timed calls per side, shape and row count")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def baseline_library(rev: str) -> Path:
    """The kernels of revision `rev`, built into the cache (reused when the sources are this checkout's)."""
    with tempfile.TemporaryDirectory() as d:
        for f in native.SOURCES + native.HEADERS:
            rel = f.relative_to(ROOT).as_posix()
            out = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True)
            if out.returncode != 0:
                raise SystemExit(f"--baseline {rev}: cannot read {rel}: {out.stderr.decode().strip()}")
            (Path(d) / f.name).write_bytes(out.stdout)
        return native.build(Path(d))


def _gemm(path: Path, scheme: str):
    name = "packed_gemm" if scheme == "fp32" else "packed_gemm_i8"
    fn = getattr(ctypes.CDLL(str(path)), name)
    fn.argtypes, fn.restype = native._SIGNATURES[name]  # the signatures the engine loads them with
    return fn


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    ours_path, base_path = native.build(), baseline_library(args.baseline)
    log(f"ours {ours_path.name}, baseline {args.baseline} {base_path.name}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    figures: dict = {"baseline": args.baseline, "shapes": [list(s) for s in SHAPES]}
    ratios: dict[str, float] = {}
    for scheme in ("fp32", "int8"):
        fns = [_gemm(ours_path, scheme), _gemm(base_path, scheme)]
        packs = []
        for out, inp in SHAPES:
            w = torch.randn(out, inp) * 0.02
            packs.append(pack_weight(w, quantization=None if scheme == "fp32" else "int8wo"))
        for rows in rows_list:
            total, same = [0.0, 0.0], True
            for (out, inp), p in zip(SHAPES, packs, strict=True):
                x = torch.randn(rows, inp)
                ys = [torch.empty(rows, out), torch.empty(rows, out)]
                times: list[list[float]] = [[], []]
                for c in range(args.calls + 2):
                    for side in ((0, 1) if c % 2 == 0 else (1, 0)):
                        head = [x.data_ptr(), x.stride(0), p.weight.data_ptr()]
                        if scheme == "int8":
                            head.append(p.scale.data_ptr())
                        t = time.perf_counter()
                        rc = fns[side](*head, None, ys[side].data_ptr(), out, rows, out, inp)
                        if c >= 2:  # the first two calls warm up
                            times[side].append(time.perf_counter() - t)
                        if rc:
                            raise MemoryError("panel matmul: no memory for the packed activations")
                same = same and torch.equal(ys[0], ys[1])
                for side in (0, 1):
                    total[side] += statistics.median(times[side])
            ratios[f"{scheme}_r{rows}"] = total[1] / total[0]
            figures[f"{scheme}_r{rows}"] = {"ours_ms": round(total[0] * 1e3, 4),
                                            "baseline_ms": round(total[1] * 1e3, 4), "same_bits": same}
            log(f"{scheme} {rows:4d} rows: ours {total[0] * 1e3:8.3f} ms, baseline {total[1] * 1e3:8.3f} ms "
                f"({total[1] / total[0]:.3f}x), same bits: {same}")
    return write_report(args.json, "kernels", figures, ratios)


if __name__ == "__main__":
    main()
