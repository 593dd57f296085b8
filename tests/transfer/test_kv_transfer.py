"""End-to-end KV transfer between real prefill and decode rank processes on 127.0.0.1.

Real bootstrap server, real ZMQ control plane, real engines: after a multi-chunk transfer of
non-contiguous pages (with a partial last page), a state slot list and the metadata row, the
decode side's buffers must be byte-identical to the source (for TP 1->1, 2->1 and 1->2, and between
the page-first pool and a per-layer layout), and every failure path must end both sides in Failed
with a reason.
"""

from __future__ import annotations

import random

import pytest

from tests.transfer import kv_harness as h
from transfer.base import KVPoll

REAL = ["mooncake", "nixl", "ucx"]
OK = int(KVPoll.Success)
FAILED = int(KVPoll.Failed)


def make_spec(backend: str, seed: int, **extra) -> dict:
    """Random page lists with one coalescable run and a non-contiguous rest; 3 chunks (4, 4, 3)."""
    rng = random.Random(seed)
    pages = h.SHAPE["pages"]
    s0, d0 = rng.randrange(1, pages - 3), rng.randrange(1, pages - 3)
    src = [s0, s0 + 1, s0 + 2] + rng.sample([p for p in range(1, pages) if not s0 <= p <= s0 + 2], 8)
    dst = [d0, d0 + 1, d0 + 2] + rng.sample([p for p in range(1, pages) if not d0 <= p <= d0 + 2], 8)
    rng.shuffle(order := list(range(3, 11)))
    src = src[:3] + [src[i] for i in order]
    slots = h.SHAPE["state_slots"]
    spec = {"backend": backend, "room": rng.randrange(1, 2**62), "seed": seed, "src_pages": src,
            "dst_pages": dst, "chunks": [4, 4, 3], "src_meta": rng.randrange(h.SHAPE["meta_slots"]),
            "dst_meta": rng.randrange(h.SHAPE["meta_slots"]), "src_state": rng.sample(range(slots), 2),
            "dst_state": rng.sample(range(slots), 2)}
    spec.update(extra)
    if "mode" not in extra:  # these check the bytes, not death detection (the kill tests keep FAST's 3 s):
        # a 10 s window, as a rank under two busy test workers was once silent for 3 s right after its
        # engine started (stop 40's CI, nixl)
        for side in ("prefill_settings", "decode_settings"):
            spec[side] = {"heartbeat_max_failures": 20, **extra.get(side, {})}
    return spec


def by_side(results: list[dict], side: str) -> list[dict]:
    return sorted((r for r in results if r["side"] == side), key=lambda r: r["rank"])


@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 2)], ids=["tp1to1", "tp2to1", "tp1to2"])
def test_loopback_bytes_identical(rank_pool, warm_backend, backend, tp):
    warm_backend(backend)
    p, d = tp
    results = rank_pool.run(make_spec(backend, seed=11 * p + d), p, d)
    assert len(results) == p + d, results
    for r in by_side(results, "prefill"):
        assert r["poll"] == OK, r
    for r in by_side(results, "decode"):
        assert r["poll"] == OK, r
        assert r["bytes_ok"] is True, r.get("detail")


@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("split,tp", [("prefill", (1, 1)), ("decode", (2, 1))],
                         ids=["split_prefill", "split_decode"])
def test_per_layer_and_page_first_pools_exchange_pages(rank_pool, warm_backend, backend, split, tp):
    """One side keeps a separate tensor per layer (stride = one page), the other the page-first pool."""
    warm_backend(backend)
    p, d = tp
    results = rank_pool.run(make_spec(backend, seed=13 * p + d, split=split), p, d)
    assert len(results) == p + d, results
    for r in results:
        assert r["poll"] == OK, r
    for r in by_side(results, "decode"):
        assert r["bytes_ok"] is True, r.get("detail")


def test_fake_backend_reaches_success(rank_pool, warm_backend):
    warm_backend("fake")
    results = rank_pool.run(make_spec("fake", seed=3), 2, 1)
    assert len(results) == 3 and all(r["poll"] == OK for r in results), results


@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_head_sliced_chunks_and_state_in_device_memory_keep_their_kinds(rank_pool, warm_backend, tp):
    """M:N TP, chunked page-aligned sends and the hybrid state, every buffer but the metadata rows declared
    cuda:0 on both sides: the fake engine refuses any region written with another kind than it lives in
    (transfer/memory.py), so Success means the planner kept every region's kind."""
    warm_backend("fake")
    p, d = tp
    kinds = {"kv_memory": "cuda:0", "state_memory": "cuda:0"}
    results = rank_pool.run(make_spec("fake", seed=17 * p + d, **kinds), p, d)
    assert len(results) == p + d and all(r["poll"] == OK for r in results), results


def test_room_mismatch_fails_receiver(rank_pool, warm_backend):
    warm_backend("mooncake")
    spec = make_spec("mooncake", seed=5)
    spec["meta_room"] = spec["room"] + 1
    results = rank_pool.run(spec)
    (dec,) = by_side(results, "decode")
    assert dec["poll"] == FAILED and "room mismatch" in dec["reason"], dec


@pytest.mark.parametrize("backend", ["mooncake", "fake"])
def test_injected_failure_fails_both_sides(rank_pool, warm_backend, backend):
    warm_backend(backend)
    results = rank_pool.run(make_spec(backend, seed=6, prefill_settings={"failure_prob": 1.0}))
    assert len(results) == 2, results
    for r in results:
        assert r["poll"] == FAILED and "injected failure" in r["reason"], r


@pytest.mark.parametrize("mode,loser,word", [("abort_prefill", "decode", "aborted by the prefill side"),
                                             ("abort_decode", "prefill", "aborted by the decode side")])
def test_abort_ends_peer_in_failed(rank_pool, warm_backend, mode, loser, word):
    warm_backend("mooncake")
    results = rank_pool.run(make_spec("mooncake", seed=8, mode=mode))
    assert len(results) == 2, results
    for r in results:
        assert r["poll"] == FAILED, r
    (other,) = by_side(results, loser)
    assert word in other["reason"], other


def test_prefill_killed_mid_transfer():
    results = h.run(make_spec("mooncake", seed=9, mode="kill_prefill", light=True), kill="prefill")
    (dec,) = by_side(results, "decode")
    assert dec["poll"] == FAILED and "heartbeats" in dec["reason"], dec


def test_decode_killed_mid_transfer():
    results = h.run(make_spec("mooncake", seed=10, mode="kill_decode", light=True), kill="decode")
    (pre,) = by_side(results, "prefill")
    assert pre["poll"] == FAILED and pre["reason"], pre
