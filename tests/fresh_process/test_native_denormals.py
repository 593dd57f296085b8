"""Loading the native kernels (common/layers/native.py) leaves the process's floating-point mode alone. The
kernels' results: tests/unit/test_native_kernels.py."""

from __future__ import annotations

import subprocess
import sys


def test_loading_the_kernels_keeps_denormals():
    """The library is built with -ffast-math; linked with it, GCC's crtfastmath.o would switch the
    loading process to flush-to-zero (torch's numerics and hypothesis both notice). Checked in a fresh
    interpreter, since this one may have loaded the library already."""
    probe = ("import numpy as np, torch\n"
             "from common.layers import native\n"
             "assert native.add_rms_norm() is not None\n"
             "print(bool(np.float32(1e-40) * np.float32(1.0) != 0))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
