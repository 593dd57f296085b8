"""The Triton attention kernels (common/layers/triton_kernels.py) compile for sm_90 as a GPU runs them, in a
fresh interpreter without TRITON_INTERPRET; no GPU needed. Their results under the interpreter:
tests/unit/test_triton_attention.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (make setup installs triton==3.6.0)")

ROOT = Path(__file__).resolve().parents[2]


COMPILE_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from common.layers import triton_kernels as tk

assert not tk.interpreted()
P = {"float32": "*fp32", "bfloat16": "*bf16"}


def build(fn, pointers, consts, **opts):
    def scalar(name):
        return "constexpr" if name in consts else "fp32" if name == "qk_scale" else "i32"

    sig = {name: pointers.get(name, scalar(name)) for name in fn.arg_names}
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options=opts)


CASES = (("bfloat16", "bfloat16", 128, 4, True), ("float32", "bfloat16", 80, 7, False))
for q, kv, d, group, extend in CASES:
    half = q == kv != "float32"
    bd = triton.next_power_of_2(d)
    idx = dict(r2t_ptr="*i64", req_rows_ptr="*i64", loc_ptr="*i64", seq_lens_ptr="*i32", q_start_ptr="*i32",
               ext_lens_ptr="*i32", prefix_lens_ptr="*i32", block_req_ptr="*i32", block_m_ptr="*i32",
               mid_o_ptr="*fp32", mid_lse_ptr="*fp32")
    ptrs = dict(idx, q_ptr=P[q], k_ptr=P[kv], v_ptr=P[kv], out_ptr=P[q], flat_ptr=P[kv])
    build(tk._store_kv_kernel, ptrs, dict(PAGE_SIZE=16, HEAD_DIM=d, BLOCK_D=bd))
    build(tk._decode_stage1_kernel, ptrs, dict(NUM_HEADS=2 * group, GROUP=group, HEAD_DIM=d, PAGE_SIZE=16,
                                               NUM_SPLITS=16, BLOCK_G=16, BLOCK_D=bd, BLOCK_N=64,
                                               HALF_DOT=half),
                                               num_warps=4, num_stages=2)
    build(tk._decode_stage2_kernel, ptrs, dict(NUM_HEADS=2 * group, HEAD_DIM=d, NUM_SPLITS=16, BLOCK_S=16,
                                               BLOCK_D=bd))
    if extend:
        ptrs.update(k_ptr=P[q], v_ptr=P[q])
        build(tk._extend_kernel, ptrs, dict(GROUP=group, HEAD_DIM=d, PAGE_SIZE=16, BLOCK_M=64, BLOCK_N=64,
                                            BLOCK_D=bd, HALF_DOT=half), num_warps=4, num_stages=2)
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The kernels as a GPU runs them (the `for` loops, the half and IEEE dots) compile for sm_90 with the
    ptxas that ships in the triton wheel; no GPU needed. A fresh interpreter, without TRITON_INTERPRET."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel carries no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, and leave no cache behind
    proc = subprocess.run([sys.executable, "-c", COMPILE_CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
