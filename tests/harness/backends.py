"""Which transfer backends can run here.

`@pytest.mark.backend("nixl")` on a test (or on a parameter: `backend_params("mooncake", "nixl")`)
skips it when the backend's engine cannot be built on this machine (its library is missing); the
hook is in tests/conftest.py. The check builds the engine once per session in a child process, so
the test process never loads the library itself.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from tests.harness.nodes import ROOT

REAL_BACKENDS = ("mooncake", "nixl", "ucx")

_CHECK = ("import sys\nfrom transfer.backends import create_engine\nfrom transfer.engine import "
          "BackendUnavailable\ntry:\n    create_engine(sys.argv[1])\nexcept BackendUnavailable as e:\n    "
          "print('UNAVAILABLE', e)\n")


@functools.cache
def backend_problem(name: str) -> str:
    """Empty when the backend's engine can be built here; else why not (the library is missing)."""
    if name not in ("fake", *REAL_BACKENDS):
        raise ValueError(f"unknown transfer backend {name!r}")
    out = subprocess.run([sys.executable, "-c", _CHECK, name], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    return out.stdout.strip() if "UNAVAILABLE" in out.stdout else ""


def backend_params(*names: str) -> list:
    """`pytest.param(name, marks=pytest.mark.backend(name), id=name)` for each name: a parametrize
    list (or fixture params) whose items skip where the backend is missing."""
    return [pytest.param(n, marks=pytest.mark.backend(n), id=n) for n in names]
