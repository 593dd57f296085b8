"""Native CPU kernels, compiled once with the system C compiler and loaded with ctypes.

`paged_decode_attention()` (`paged_attention.c`), `prefill_attention()` (`prefill_attention.c`),
`add_rms_norm()` (`rms_norm.c`), `rotary_apply()` (`rotary.c`), `silu_and_mul()` (`activation.c`),
`kv_store()` (`kv_store.c`), `argmax_rows()` (`argmax.c`), `pin_team()` (`threads.c`), `packed_gemm()`,
`packed_gemm_i8()` and `packed_gemm_silu()` (`gemm.c`), `packed_gemm_blocks()` and `block_panels_equal()`
(`gemm_blocks.c`), `packed_gemm_w8a8()` (`gemm_w8a8.c`), `moe_experts()` (`moe_experts.c`) and
`decoder_stack()` (`decoder_stack.c`, which chains the others through a decode step of a whole
Llama-family stack), and for the benches `fma_peak_gflops()` (`fma_peak.c`), return the loaded C
function, or None when it cannot be used (no C compiler, a failed build, no AVX2 for the GEMM, or
`PDSERVE_NATIVE_KERNELS=0`); callers then take the torch paths, which compute the same thing. The GEMM
reads each weight once per matmul from a panel layout and beats oneDNN's packed matmul at decode batch
sizes (`common/layers/linear.py`); the others replace chains of small torch ops whose per-op dispatch
dominates at decode batch sizes (a residual add + F.rms_norm on one 576-wide
row: ~24 us here; the kernel ~14 us).

The shared object is cached under `$PDSERVE_CACHE_DIR/native` (default `~/.cache/pdserve/native`),
named by a hash of the sources and the compiler flags, and written atomically, so concurrent
processes may build it at the same time. `PDSERVE_NATIVE_ISA=avx2` builds for AVX2 and FMA alone on a
CPU that has AVX-512 as well (the kernels an AVX2-only host runs, same bits; `pdserve bench kernels
--isa avx2`). OpenMP comes from the runtime torch has already loaded, so the kernel honours
`torch.set_num_threads`. `make setup` builds it ahead of time (`python -m common.layers.native`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

HEADERS = [Path(__file__).with_name("vec_math.h")]
SOURCES = [Path(__file__).with_name(f) for f in ("paged_attention.c", "rms_norm.c", "rotary.c", "gemm.c",
                                                 "gemm_w8a8.c", "activation.c", "argmax.c", "decoder_stack.c",
                                                 "prefill_attention.c", "threads.c", "gemm_blocks.c",
                                                 "moe_experts.c", "kv_store.c", "fma_peak.c")]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags() -> list[str]:
    # fast-math lets expf vectorise (glibc's libmvec); infinities stay (the running max starts at -inf).
    # Compile-only: see build() for why the link step must not see -ffast-math.
    flags = ["-O3", "-fPIC", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
    cpu = _cpu_flags()
    isa = os.environ.get("PDSERVE_NATIVE_ISA", "native")
    if isa == "avx2":
        cpu = {f for f in cpu if not f.startswith("avx512")}
    elif isa != "native":
        raise RuntimeError(f"PDSERVE_NATIVE_ISA={isa!r}: expected native or avx2")
    if {"avx2", "fma", "f16c"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx512f" in cpu:  # the GEMM's 16-column panels then fit one register (gemm.c)
            flags.append("-mavx512f")
            if {"avx512bw", "avx512_vnni"} <= cpu:  # byte dot products for w8a8 (gemm_w8a8.c)
                flags += ["-mavx512bw", "-mavx512vnni"]
    return flags


def _cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return Path(root) / "native"


def build(src_dir: Path | None = None) -> Path:
    """Compile the kernels into the cache (if not there yet); returns the shared object's path. `src_dir`:
    a directory holding the same files in another version (`pdserve bench kernels --baseline`); a file that
    version did not have yet is left out."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    flags = _compile_flags()
    # (a source's `#include "vec_math.h"` finds the header next to it)
    sources, headers = ((SOURCES, HEADERS) if src_dir is None
                        else ([q for p in SOURCES if (q := Path(src_dir) / p.name).exists()],
                              [q for p in HEADERS if (q := Path(src_dir) / p.name).exists()]))
    src = b"".join(p.read_bytes() for p in sources + headers)
    digest = hashlib.sha256(src + " ".join(flags + ["link-without-fast-math"]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"kernels-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    # Objects first, then a link without -ffast-math: linking a shared object with it pulls in GCC's
    # crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
    # process that loads the kernels (torch's numerics included), not just for these loops.
    with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
        try:
            objs = [os.path.join(objdir, p.stem + ".o") for p in sources]
            for src_path, obj in zip(sources, objs, strict=True):
                _run(compiler, [*flags, "-c", str(src_path), "-o", obj])
            _run(compiler, ["-shared", "-fopenmp", *objs, "-o", tmp, "-lm"])
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    logger.info("built %s", out)
    return out


def _run(compiler: str, args: list[str]) -> None:
    proc = subprocess.run([compiler, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "paged_decode_attention": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                _I64, _I64, _I64, _F32, _PTR, _PTR, _I64, _PTR, _I64, _PTR], ctypes.c_int),
    "add_rms_norm": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32], None),
    "kv_store": ([_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64], None),
    "rotary_apply": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64], None),
    "packed_gemm": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64], ctypes.c_int),
    "packed_gemm_supported": ([], ctypes.c_int),
    "packed_gemm_i8": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64], ctypes.c_int),
    "packed_gemm_silu": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64], ctypes.c_int),
    "packed_gemm_silu_cols": ([], ctypes.c_int),
    "packed_gemm_w8a8": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64], ctypes.c_int),
    "packed_gemm_blocks": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64], ctypes.c_int),
    "pack_weight_blocks": ([_I64, _PTR, _I64, _I64, _PTR], None),
    "block_panels_equal": ([_I64, _PTR, _I64, _I64, _PTR], ctypes.c_int),
    "packed_gemm_blocks_rows": ([], ctypes.c_int),
    "packed_gemm_w8a8_group": ([], ctypes.c_int),
    "packed_gemm_w8a8_block": ([], ctypes.c_int),
    "packed_gemm_w8a8_weight_max": ([], ctypes.c_int),
    "packed_gemm_w8a8_comp_lines": ([], ctypes.c_int),
    "silu_and_mul": ([_PTR, _I64, _PTR, _I64, _I64], None),
    "argmax_rows": ([_PTR, _I64, _I64, _I64, _PTR], None),
    "decoder_stack": ([_PTR, _I64, _PTR, _PTR, _PTR], ctypes.c_int),
    "prefill_attention": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                           _I64, _F32, _PTR, _I64],
                          ctypes.c_int),
    "prefill_attention_block": ([], ctypes.c_int),
    "pin_team": ([_I64, _PTR, _I64], ctypes.c_int),
    "fma_peak_gflops": ([_I64, ctypes.c_int], ctypes.c_double),
    "moe_experts_f32": ([_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR], ctypes.c_int),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    import torch  # noqa: F401  (its OpenMP runtime must be loaded first)

    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        logger.warning("native CPU kernels unavailable, using the torch paths: %s", e)
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


def _kernel(name: str):
    lib = _library()
    return None if lib is None else getattr(lib, name)


def cpu_tensors(*tensors) -> bool:
    """The guard in front of every kernel call: the kernels read and write host memory, so a tensor on
    another device (None entries are skipped) takes the caller's torch path instead."""
    return all(t is None or t.device.type == "cpu" for t in tensors)


def paged_decode_attention():
    return _kernel("paged_decode_attention")


@functools.cache
def prefill_attention() -> tuple | None:
    """(causal prefill attention of one sequence, the head size it needs a multiple of), or None."""
    lib = _library()
    return (lib.prefill_attention, lib.prefill_attention_block()) \
        if lib and lib.prefill_attention_block() else None


def kv_store():
    """New tokens' K and V into a float32 pool (`kv_store.c`)."""
    return _kernel("kv_store")


def add_rms_norm():
    return _kernel("add_rms_norm")


def rotary_apply():
    return _kernel("rotary_apply")


def decoder_stack():
    """Whole-stack decode (`decoder_stack.c`); it runs the panel GEMM, so it needs AVX2 + FMA too."""
    return _kernel("decoder_stack") if packed_gemm() is not None else None


def moe_experts():
    """A mixture-of-experts block's experts over a batch in one call (`moe_experts.c`); AVX2 + FMA."""
    return _kernel("moe_experts_f32") if packed_gemm() is not None else None


def pin_team():
    """`pin_team(n, sets, width)`: thread t of the OpenMP team of n runs only on the cores of row t
    (`threads.c`)."""
    return _kernel("pin_team")


def fma_peak_gflops():
    """`fma_peak_gflops(steps, threads)`: the float32 FMA rate of `threads` threads (0: the team's), from
    registers alone (`fma_peak.c`)."""
    return _kernel("fma_peak_gflops")


def argmax_rows():
    return _kernel("argmax_rows")


def silu_and_mul():
    return _kernel("silu_and_mul")


@functools.cache
def packed_gemm():
    lib = _library()
    return lib.packed_gemm if lib is not None and lib.packed_gemm_supported() else None


def packed_gemm_i8():
    """The panel GEMM over int8 weights with a float32 scale per output column (`--torchao-config int8wo`)."""
    return _kernel("packed_gemm_i8") if packed_gemm() is not None else None


def packed_gemm_silu():
    """The MLP's gate-and-up matmul and its SiLU-and-mul in one pass over float32 or int8 panels."""
    return _kernel("packed_gemm_silu") if packed_gemm() is not None else None


def packed_gemm_silu_cols() -> int:
    """What the MLP's width must be a multiple of for `packed_gemm_silu`; 0 without it."""
    return _library().packed_gemm_silu_cols() if packed_gemm() is not None else 0


def packed_gemm_w8a8():
    """Int8 weights times int8 activations (a scale per token and 64 input channels), summed in int32
    (`--quantization w8a8_int8`)."""
    return _kernel("packed_gemm_w8a8") if packed_gemm() is not None else None


def packed_gemm_blocks():
    """The panel GEMM over float32 weights kept as their checkpoint's blocks of 32 (`gemm_blocks.c`)."""
    return _kernel("packed_gemm_blocks") if packed_gemm() is not None else None


def block_rows() -> int:
    """The most rows for which `packed_gemm_blocks` is used at this thread count (float32 panels beyond), 0
    without it."""
    lib = _library()
    return lib.packed_gemm_blocks_rows() if packed_gemm() is not None else 0


def pack_weight_blocks():
    """`gemm_blocks.c`'s packing of a float32 weight as a checkpoint's blocks, or None without the panel
    GEMM."""
    return _kernel("pack_weight_blocks") if packed_gemm() is not None else None


def block_panels_equal():
    """`gemm_blocks.c`'s check that blocks widen to given float32 panels bit for bit, or None without the
    panel GEMM."""
    return _kernel("block_panels_equal") if packed_gemm() is not None else None


@functools.cache
def w8a8_layout() -> tuple[int, int, int, int]:
    """The w8a8 panels this build reads: (steps of k per weight group; input channels per activation
    scale, to which K is padded; the weights' bound, |q| <= it; 1 where each block leads with its line of
    weight sums (AVX2), 0 where the kernel sums them itself (AVX-512 VNNI))."""
    lib = _library()
    return (0, 0, 0, 0) if lib is None else library_w8a8_layout(lib)


def library_w8a8_layout(lib: ctypes.CDLL) -> tuple[int, int, int, int]:
    """`w8a8_layout()` of a given library (`pdserve bench kernels` loads builds beside the process's own)."""
    return (lib.packed_gemm_w8a8_group(), lib.packed_gemm_w8a8_block(), lib.packed_gemm_w8a8_weight_max(),
            lib.packed_gemm_w8a8_comp_lines())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build())
    sys.exit(0 if _library() is not None else 1)
