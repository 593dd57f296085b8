"""Core lending between a prefill node and its decode node (common/core_loan.py): the shared byte, the
borrower's threads and where they run, and the flags' checks. The whole path (the launcher's files and
flags, a decode forward on the lent core) is in tests/deploy/test_cluster.py."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common import core_loan
from common.config import ConfigError, ServerArgs
from common.cores import parse_cores

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_lender_writes_busy_at_start_idle_when_told_and_counts_idle_time(tmp_path):
    path = str(tmp_path / "loan")
    peer = core_loan.open_loan_file(path)
    peer[0] = core_loan.IDLE  # a stale byte from a lender that died idle
    lender = core_loan.Lender(path)
    assert peer[0] == core_loan.BUSY  # a (re)started lender lends nothing until it idles
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lender.set_idle(True)
    assert peer[0] == core_loan.IDLE
    lender.set_idle(True)
    lender.set_idle(False)
    assert peer[0] == core_loan.BUSY
    idle = lender.stats()["core_loan_idle_seconds"]
    assert idle > 0 and lender.stats() == {"core_loan_role": "lender", "core_loan_idle_seconds": idle}


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
    r = subprocess.run([sys.executable, "-c", BORROWER, str(own), str(lent), str(tmp_path / "loan")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert (seen["busy"], seen["idle"], seen["garbage_byte"]) == (1, 2, 1)
    assert seen["main"] == str(own)
    assert str(lent) in seen["others"]  # the OpenMP thread of the lent core runs there and nowhere else
    assert seen["stats"] == {"core_loan_role": "borrower", "core_loan_lent_forwards": 2, "core_loan_forwards": 4,
                             "core_loan_contended_forwards": 1}


def test_borrower_refuses_a_lent_core_of_its_own(tmp_path):
    with pytest.raises(RuntimeError, match="own and lent"):
        core_loan.Borrower(str(tmp_path / "loan"), [0, 1], [1])


def test_core_lists():
    assert parse_cores("0-2,5,5") == [0, 1, 2, 5]
    for bad in ("3-1", "", "a", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cores(bad)


@pytest.mark.parametrize("argv, flag", [
    (("--core-loan-cores", "0"), "--core-loan-cores"),  # not a decode node
    (("--disaggregation-mode", "decode", "--core-loan-cores", "0"), "--core-loan-cores"),  # no file
    (("--disaggregation-mode", "decode", "--core-loan-file", "{f}", "--core-loan-cores", "2-1"), "--core-loan-cores"),
    (("--core-loan-file", "{f}"), "--core-loan-file"),  # colocated
    (("--disaggregation-mode", "decode", "--core-loan-file", "{f}"), "--core-loan-file"),  # no cores
    (("--disaggregation-mode", "prefill", "--core-loan-file", "{f}", "--core-loan-cores", "0"), "--core-loan-cores"),
    (("--disaggregation-mode", "decode", "--core-loan-file", "{f}", "--core-loan-cores", "0", "--tp", "2"),
     "--core-loan-file"),
    (("--disaggregation-mode", "decode", "--core-loan-file", "{f}", "--core-loan-cores", "0",
      "--enable-overlap-schedule"), "--core-loan-file"),
    (("--disaggregation-mode", "prefill", "--core-loan-file", "{f}", "--dp-size", "2"), "--core-loan-file"),
    (("--disaggregation-mode", "prefill", "--core-loan-file", "/no/such/dir/loan"), "--core-loan-file"),
])
def test_invalid_core_loan_flags_name_the_flag(argv, flag, tmp_path):
    argv = [a.replace("{f}", str(tmp_path / "loan")) for a in argv]
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    assert str(e.value).startswith(flag + ":"), str(e.value)


def test_valid_core_loan_flags(tmp_path):
    f = str(tmp_path / "loan")
    assert parse("--disaggregation-mode", "prefill", "--core-loan-file", f, "--tp", "2").core_loan_file == f
    args = parse("--disaggregation-mode", "decode", "--core-loan-file", f, "--core-loan-cores", "0-1")
    assert args.core_loan_cores == "0-1"
