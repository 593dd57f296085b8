"""Byte-level tests of the nixl and ucx engines between two real processes on 127.0.0.1.

The destination process owns zeroed torch buffers, the source process owns random bytes; they
exchange `describe()` blobs through pipes, the source writes a random non-contiguous set of
regions, and the destination checks every byte (written regions equal the source, the rest zero).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

ENGINES = ["nixl", "ucx"]
DST_BUFFERS = 2  # registered separately, so a batch spans several remote registrations
DST_BYTES = 6 << 20  # per destination buffer
SRC_BYTES = 8 << 20
SRC_SEED = 1234
STEP_TIMEOUT_S = 60.0


def _make_engine(name: str, **kwargs):
    if name == "nixl":
        from transfer.nixl import NixlEngine

        return NixlEngine(**kwargs)
    from transfer.ucx import UcxEngine

    return UcxEngine(**kwargs)


def _source_bytes():
    import torch

    gen = torch.Generator().manual_seed(SRC_SEED)
    return torch.randint(0, 256, (SRC_BYTES,), dtype=torch.uint8, generator=gen)


def _dst_main(engine_name: str, conn) -> None:
    """Destination: register zeroed buffers, publish the description, verify on request."""
    import torch

    from transfer.engine import BackendUnavailable

    try:
        engine = _make_engine(engine_name)
    except BackendUnavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    bufs = [torch.zeros(DST_BYTES, dtype=torch.uint8) for _ in range(DST_BUFFERS)]
    for b in bufs:
        engine.register(b.data_ptr(), b.numel())
    conn.send(("ready", engine.describe(), [b.data_ptr() for b in bufs]))
    msg = conn.recv()  # ("verify", plan) or "bye"; the parent may also just kill us
    if msg == "bye":
        engine.close()
        return
    plan = msg[1]
    src = _source_bytes()
    written = [torch.zeros(DST_BYTES, dtype=torch.bool) for _ in range(DST_BUFFERS)]
    errors = []
    for buf_idx, dst_off, src_off, n in plan:
        got, want = bufs[buf_idx][dst_off : dst_off + n], src[src_off : src_off + n]
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0])
            errors.append(f"region buf{buf_idx}+{dst_off} len {n}: first mismatch at byte {bad}")
        written[buf_idx][dst_off : dst_off + n] = True
    for i, b in enumerate(bufs):
        stray = int(b[~written[i]].count_nonzero())
        if stray:
            errors.append(f"buffer {i}: {stray} non-zero bytes outside the written regions")
    conn.send(("verified", errors[:10], sum(n for *_, n in plan)))
    conn.recv()  # keep the memory registered until the parent is done
    engine.close()


def _src_main(engine_name: str, conn, timeout: float) -> None:
    """Source: write the plan into the peer; on request, write again (after the peer died)."""
    import threading

    from transfer.engine import BackendUnavailable, TransferError

    try:
        engine = _make_engine(engine_name, timeout=timeout)
    except BackendUnavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    src = _source_bytes()
    engine.register(src.data_ptr(), src.numel())
    _, description, dst_ptrs, plan = conn.recv()
    peer = engine.add_peer(description)
    assert engine.add_peer(description) == peer, "add_peer must be idempotent"

    def batch(entries):
        return (
            [src.data_ptr() + s for _, _, s, _ in entries],
            [dst_ptrs[b] + d for b, d, _, _ in entries],
            [n for *_, n in entries],
        )

    # Half the regions in one call, the rest from three threads at once (write is thread-safe).
    half = len(plan) // 2
    engine.write(peer, *batch(plan[:half]))
    errors: list[BaseException] = []

    def worker(entries):
        try:
            engine.write(peer, *batch(entries))
        except BaseException as exc:  # reported to the parent below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(plan[half + k :: 3],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send(("written", [repr(e) for e in errors]))
    if conn.recv() != "write-again":
        engine.close()
        return
    start = time.monotonic()
    try:
        engine.write(peer, *batch(plan))
        outcome = "no error"
    except TransferError as exc:
        outcome = f"TransferError: {exc}"
    except Exception as exc:
        outcome = f"wrong exception {type(exc).__name__}: {exc}"
    conn.send(("rewritten", outcome, time.monotonic() - start))
    conn.recv()
    engine.close()


def _make_plan(rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
    """Non-overlapping destination regions (buffer, dst offset, src offset, length):
    many small ones plus a few of 1-2 MiB, separated by random gaps, in shuffled order."""
    plan = []
    for buf_idx in range(DST_BUFFERS):
        sizes = list(rng.integers(1, 8192, size=150)) + list(rng.integers(1 << 20, 2 << 20, size=2))
        sizes = [int(s) for s in rng.permutation(sizes)]
        off = int(rng.integers(0, 4096))
        for n in sizes:
            if off + n > DST_BYTES:
                break
            plan.append((buf_idx, off, int(rng.integers(0, SRC_BYTES - n)), n))
            off += n + int(rng.integers(1, 4096))
    order = rng.permutation(len(plan))
    return [plan[i] for i in order]


def _recv(conn, proc, what: str):
    if not conn.poll(STEP_TIMEOUT_S):
        raise AssertionError(f"{what}: no answer within {STEP_TIMEOUT_S}s (alive={proc.is_alive()})")
    return conn.recv()


class _Pair:
    """A destination and a source process with a pipe to each."""

    def __init__(self, engine_name: str, src_timeout: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self.dst_conn, dst_child = ctx.Pipe()
        self.src_conn, src_child = ctx.Pipe()
        self.dst = ctx.Process(target=_dst_main, args=(engine_name, dst_child), daemon=True)
        self.src = ctx.Process(target=_src_main, args=(engine_name, src_child, src_timeout), daemon=True)
        self.dst.start()
        self.src.start()

    def start(self, plan):
        ready = _recv(self.dst_conn, self.dst, "destination start")
        if ready[0] == "unavailable":
            pytest.skip(f"backend library not importable: {ready[1]}")
        self.src_conn.send(("go", ready[1], ready[2], plan))
        written = _recv(self.src_conn, self.src, "source write")
        if written[0] == "unavailable":
            pytest.skip(f"backend library not importable: {written[1]}")
        return written

    def close(self) -> None:
        for conn in (self.dst_conn, self.src_conn):
            try:
                conn.send("bye")
            except (BrokenPipeError, OSError):
                pass
        for p in (self.src, self.dst):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_scattered_write_is_byte_exact(engine_name: str) -> None:
    plan = _make_plan(np.random.default_rng(7))
    assert sum(n for *_, n in plan) > 4 << 20 and len(plan) > 200
    pair = _Pair(engine_name)
    try:
        written = pair.start(plan)
        assert written == ("written", []), written
        pair.dst_conn.send(("verify", plan))
        tag, errors, total = _recv(pair.dst_conn, pair.dst, "destination verify")
        assert tag == "verified"
        assert errors == [], errors
        assert total == sum(n for *_, n in plan)
    finally:
        pair.close()


@pytest.mark.parametrize("engine_name", ENGINES)
def test_write_to_dead_peer_raises(engine_name: str) -> None:
    plan = _make_plan(np.random.default_rng(11))
    pair = _Pair(engine_name, src_timeout=5.0)
    try:
        written = pair.start(plan)
        assert written == ("written", []), written  # the connection is up and working
        os.kill(pair.dst.pid, signal.SIGKILL)
        pair.dst.join(10)
        assert not pair.dst.is_alive()
        start = time.monotonic()
        pair.src_conn.send("write-again")
        tag, outcome, elapsed = _recv(pair.src_conn, pair.src, "write to dead peer")
        assert tag == "rewritten"
        assert outcome.startswith("TransferError"), outcome
        assert elapsed < 30 and time.monotonic() - start < 30
    finally:
        pair.close()
