"""A core borrower in a fresh process (common/core_loan.py): its extra OpenMP thread runs pinned to the lent
core, only while the lender idles, and its figures count the lent and contended forwards. The shared byte
and the flags' checks: tests/unit/test_core_loan.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


BORROWER = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from common import core_loan
    own, lent, path = [int(sys.argv[1])], [int(sys.argv[2])], sys.argv[3]
    os.sched_setaffinity(0, own)
    torch.set_num_threads(1)
    lender = core_loan.Lender(path)
    b = core_loan.Borrower(path, own, lent)
    seen = {}

    def forward(idle, byte=None):
        lender.set_idle(idle)
        if byte is not None:
            lender._mm[0] = byte
        b.before_forward()
        a = torch.randn(512, 512)
        for _ in range(20):
            a = torch.tanh(a @ a)  # parallel regions on the team of b.threads
        return torch.get_num_threads()

    seen["busy"] = forward(False)
    seen["idle"] = forward(True)
    allowed = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(l for l in f if l.startswith("Cpus_allowed_list"))
        allowed[tid] = line.split(":")[1].strip()
    seen["main"] = allowed.pop(str(threading.get_native_id()))
    seen["others"] = sorted(set(allowed.values()))
    b.after_forward()  # the lender still idles: not contended
    seen["garbage_byte"] = forward(True, byte=7)  # anything but IDLE reads as busy
    b.after_forward()  # a forward on its own threads is never contended
    lender.set_idle(False)
    forward(True)
    lender.set_idle(False)  # the prefill node woke up during a lent forward
    b.after_forward()
    seen["stats"] = b.stats()
    print(json.dumps(seen))
""")


def test_borrower_runs_extra_threads_pinned_to_the_lent_core_only_while_the_lender_idles(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    own, lent = cores[0], cores[1]
    argv = [sys.executable, "-c", BORROWER, str(own), str(lent), str(tmp_path / "loan")]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert (seen["busy"], seen["idle"], seen["garbage_byte"]) == (1, 2, 1)
    assert seen["main"] == str(own)
    assert str(lent) in seen["others"]  # the OpenMP thread of the lent core runs there and nowhere else
    assert seen["stats"] == {"core_loan_role": "borrower", "core_loan_lent_forwards": 2,
                             "core_loan_forwards": 4, "core_loan_contended_forwards": 1}
