"""Core lending between a prefill node and its decode node (common/core_loan.py): the shared byte and the
flags' checks. The borrower's threads in a fresh process: tests/fresh_process/test_core_loan_borrower.py; the
whole path (the launcher's files and flags, a decode forward on the lent core):
tests/deploy/test_cluster.py."""

from __future__ import annotations

import argparse
import os
import stat
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
    (("--disaggregation-mode", "decode", "--core-loan-file", "{f}", "--core-loan-cores", "2-1"),
     "--core-loan-cores"),
    (("--core-loan-file", "{f}"), "--core-loan-file"),  # colocated
    (("--disaggregation-mode", "decode", "--core-loan-file", "{f}"), "--core-loan-file"),  # no cores
    (("--disaggregation-mode", "prefill", "--core-loan-file", "{f}", "--core-loan-cores", "0"),
     "--core-loan-cores"),
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
