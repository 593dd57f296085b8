"""Core lending between the prefill node and the decode node of a pair on one machine.

`pdserve cluster` gives each node cores of its own (deploy/placement.py), so a prefill never slows a
decode step. But even in a busy run the prefill node often has nothing to run (every request is at
the decode node), and its cores idle while the decode node steps on its own. The pair
shares one byte in a file (`--core-loan-file`, created by the launcher): the lender (the prefill
node's scheduler) writes IDLE while it has no forward to run and BUSY from the moment it schedules
one; the borrower (a decode node's scheduler, `--core-loan-cores` naming the lender's cores) reads
it before each forward and runs that forward with extra OpenMP threads on the lent cores while the
byte says IDLE, on its own threads otherwise. The borrower's OpenMP threads are pinned at start-up
(`threads.c`): its own threads to its own cores, the extra ones to the lent cores, so a borrowed
thread never runs anywhere else. A forward that started on lent cores finishes there even if the
lender wakes up meanwhile (it is one decode step or one local chunk); the next one runs on the
borrower's own cores.

OpenMP threads must spin between the parallel regions of a lent forward: waking a sleeping thread costs
so much on a VM that a forward on two threads with OMP_WAIT_POLICY=PASSIVE is no faster than on one,
while spinning threads make the extra cores pay (bench/placement.py measures the loan). The
launcher sets the borrower's GOMP_SPINCOUNT (deploy/placement.py), and since libgomp spins only a
few times when it manages more threads than the process had cores when it loaded,
the borrower's scheduler process widens its affinity to the lent cores before torch loads OpenMP
(`widen_for_openmp`) and narrows it again right after.

The byte is all the pair shares: any value but IDLE reads as BUSY (a lender that never started,
or a file someone else wrote, lends nothing), and a lender that dies while idle only leaves cores
lent that no one else uses. Only the TP-1, PP-1, DP-1 decode node without overlap scheduling
borrows (its forwards run on the scheduler's own thread, whose OpenMP team is the one pinned);
config validation refuses the rest (`unsupported` here, and each role's rules: common/role_rules.py).
"""

from __future__ import annotations

import logging
import mmap
import os
import time

from common.cores import parse_cores

logger = logging.getLogger(__name__)

IDLE, BUSY = 1, 0


def open_loan_file(path: str) -> mmap.mmap:
    """The shared byte: `path` mapped read-write (created, mode 0600, if missing)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < 1:
            os.ftruncate(fd, 1)
        return mmap.mmap(fd, 1)
    finally:
        os.close(fd)


class Lender:
    """The prefill node's side: whether it has a forward to run, and for how long it had none."""

    def __init__(self, path: str) -> None:
        self._mm = open_loan_file(path)
        self._idle = False
        self._since = time.monotonic()
        self.idle_s = 0.0
        self._mm[0] = BUSY

    def set_idle(self, idle: bool) -> None:
        if idle == self._idle:
            return
        now = time.monotonic()
        if self._idle:
            self.idle_s += now - self._since
        self._since = now
        self._mm[0] = IDLE if idle else BUSY
        self._idle = idle

    def stats(self) -> dict:
        extra = time.monotonic() - self._since if self._idle else 0.0
        return {"core_loan_role": "lender", "core_loan_idle_seconds": self.idle_s + extra}


class Borrower:
    """The decode node's side: its own threads, or those plus one per lent core while the lender idles."""

    def __init__(self, path: str, own_cores: list[int], lent_cores: list[int]) -> None:
        import torch

        from common.layers import native

        overlap = sorted(set(own_cores) & set(lent_cores))
        if overlap:
            raise RuntimeError(f"core loan: cores {overlap} are this node's own and lent too")
        pin = native.pin_team()
        if pin is None:
            raise RuntimeError("core loan: needs the native kernels (common/layers/threads.c), which did "
                               "not build")
        self._torch = torch
        self._mm = open_loan_file(path)
        own_threads = torch.get_num_threads()
        self.own = own_threads
        self.total = own_threads + len(lent_cores)
        width = max(len(own_cores), 1)
        rows = [own_cores + [-1] * (width - len(own_cores))] * own_threads
        rows += [[c] + [-1] * (width - 1) for c in lent_cores]
        sets = torch.tensor(rows, dtype=torch.int64)
        torch.set_num_threads(self.total)
        pinned = pin(self.total, sets.data_ptr(), width)
        torch.set_num_threads(self.own)
        if pinned != self.total:
            raise RuntimeError(f"core loan: pinned {pinned} of {self.total} threads (are cores "
                               f"{lent_cores} here?)")
        self.threads = self.own
        self.forwards = 0
        self.lent_forwards = 0
        # lent forwards the lender woke up during (it shared its cores until they ended)
        self.contended_forwards = 0
        logger.info("core loan: forwards run %d thread(s) on cores %s, plus one on each of cores %s while "
                    "the prefill node has nothing to run", own_threads, own_cores, lent_cores)

    def lender_idle(self) -> bool:
        return self._mm[0] == IDLE

    def before_forward(self) -> None:
        want = self.total if self.lender_idle() else self.own
        if want != self.threads:
            self._torch.set_num_threads(want)
            self.threads = want
        self.forwards += 1
        self.lent_forwards += want > self.own

    def after_forward(self) -> None:
        if self.threads > self.own and not self.lender_idle():
            self.contended_forwards += 1

    def stats(self) -> dict:
        return {"core_loan_role": "borrower", "core_loan_lent_forwards": self.lent_forwards,
                "core_loan_forwards": self.forwards, "core_loan_contended_forwards": self.contended_forwards}


def unsupported(args) -> str | None:
    """Why a node of this shape cannot take part in a core loan whatever its role (None: it can); each role
    adds its own reasons (`RoleRules.core_loan_unsupported`, common/role_rules.py). Config validation refuses
    such a node's flags; the launcher leaves them out."""
    if args.dp_size > 1 or args.pp_size > 1:
        return "needs --dp-size 1 and --pp-size 1 (one scheduler says when the node idles)"
    return None


def widen_for_openmp(args, own_cores: list[int]) -> None:
    """A borrower's scheduler process, before torch loads: may run on `own_cores` and the lent cores, so
    OpenMP counts them at start-up (the caller narrows the process to `own_cores` once torch is loaded).
    The borrower is the node given the lent cores (`--core-loan-cores`, a decode node's flag)."""
    if args.core_loan_file and args.core_loan_cores:
        wide = sorted(set(own_cores) | set(parse_cores(args.core_loan_cores)))
        try:
            os.sched_setaffinity(0, wide)
        except OSError as e:
            raise RuntimeError(f"--core-loan-cores {args.core_loan_cores}: this process cannot run on cores "
                               f"{wide}: {e}") from None


def for_node(args, tp_rank: int):
    """(lender, borrower) of this scheduler rank from `--core-loan-file` / `--core-loan-cores` (validated
    by ServerArgs: the file goes to both nodes of a pair, the lent cores to the decode node only): the
    node given the lent cores borrows, the other's rank 0 lends; (None, None) without a loan file."""
    if not args.core_loan_file or tp_rank != 0:
        return None, None
    if args.core_loan_cores is None:
        return Lender(args.core_loan_file), None
    return None, Borrower(args.core_loan_file, sorted(os.sched_getaffinity(0)),
                          parse_cores(args.core_loan_cores))
