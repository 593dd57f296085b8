"""Retracted requests keep their KV (`--decode-offload-size`): the host store on its own (copies, LRU
eviction, entries too big), and the scheduler end to end on a tiny pool that forces retraction: the
same greedy tokens as a node with a big KV budget, restored requests prefill nothing again (the
prefill token counter equals the prompts), and with the store off, or too small, the fallback
recomputes and still matches. After every run the pools and the store are empty again."""

from __future__ import annotations

import pytest
import torch

from common.memory.host_store import HostKVStore, copy_pages
from common.memory.kv_pool import KVPool
from common.memory.state_pool import StatePool
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)
from tests.unit.test_engine_correctness import Engine, prompts_of

# ------------------------------------------------------------------------------------------------
# the store on its own


def _pool(pages: int = 9) -> KVPool:
    pool = KVPool(pages, 4, num_layers=2, kv_heads=2, head_dim=3)
    pool.data.copy_(torch.randn(pool.data.shape))
    return pool


def test_copy_pages_in_runs():
    src = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    dst = torch.zeros(8, 6)
    copy_pages(dst, [2, 3, 4, 0, 7], src, [5, 6, 7, 1, 9])  # runs: 5-7 -> 2-4, then single pages
    for d, s in zip([2, 3, 4, 0, 7], [5, 6, 7, 1, 9], strict=True):
        assert torch.equal(dst[d], src[s])
    assert not dst[[1, 5, 6]].any()


def test_store_and_load_round_trip_with_state():
    pool = _pool()
    states = StatePool(3, [0], conv_shape=(2, 3), recurrent_shape=(2, 2, 2))
    slot = states.alloc()
    for b in states.buffers():
        b[slot].copy_(torch.randn(b[slot].shape))
    want_kv = pool.data[[3, 5, 6]].clone()
    want_state = [b[slot].clone() for b in states.buffers()]
    store = HostKVStore(16, pool, states, state_slots=2)
    assert store.store("a", [3, 5, 6], 11, slot)
    assert "a" in store and store.kv_len("a") == 11 and store.used_tokens() == 12
    pool.data.zero_()
    new_slot = states.alloc()
    assert store.load("a", [1, 2, 8], new_slot) == 11
    assert torch.equal(pool.data[[1, 2, 8]], want_kv)
    for b, want in zip(states.buffers(), want_state, strict=True):
        assert torch.equal(b[new_slot], want)
    assert len(store) == 0 and store.used_tokens() == 0


def test_store_evicts_least_recently_stored_and_rejects_what_never_fits():
    pool = _pool()
    store = HostKVStore(16, pool)  # 4 pages
    assert store.store("a", [1, 2], 8) and store.store("b", [3], 2)
    assert store.store("c", [4, 5], 6)  # 5 pages needed: "a" (the oldest) goes
    assert "a" not in store and "b" in store and "c" in store and store.evictions == 1
    assert not store.store("huge", [1, 2, 3, 4, 5], 20) and store.rejected == 1
    assert "b" in store and "c" in store  # a rejected entry evicts nothing
    store.discard("b")
    store.discard("b")  # unknown: no-op
    assert store.used_tokens() == 8 and store.stats()["decode_offload_entries"] == 1
    with pytest.raises(ValueError):
        HostKVStore(3, pool)  # less than a page


# ------------------------------------------------------------------------------------------------
# the scheduler: retraction on a tiny pool (the settings of test_engine_correctness's retraction test)

TINY = dict(page_size=4, max_total_tokens=160, chunked_prefill_size=32, init_new_token_ratio=0.05,
            min_new_token_ratio=0.01)
LENS = [20, 22, 18, 25, 21, 19]
MAX_NEW = 30


def _run(model_dir, vocab, **settings):
    eng = Engine(model_dir, **settings)
    prompts = prompts_of(LENS, vocab, seed=11)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=MAX_NEW)
    got = eng.run()
    stats = eng.sched.get_stats()
    eng.assert_restored()
    store = eng.sched.host_store
    assert store is None or (len(store) == 0 and store.used_tokens() == 0)
    return got, stats


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    import json
    import os

    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, vocab):
    got, stats = _run(tiny_model_dir, vocab, page_size=4, max_total_tokens=4096, chunked_prefill_size=32)
    assert stats["num_retractions"] == 0
    return got


def test_retracted_requests_resume_from_the_host_store(tiny_model_dir, vocab, reference):
    got, s = _run(tiny_model_dir, vocab, decode_offload_size=4096, **TINY)
    assert got == reference
    assert s["num_retractions"] > 0, "the pool was meant to run out"
    assert s["num_retract_offloaded"] == s["num_retractions"] == s["num_retract_restored"]
    assert s["num_retract_recomputed"] == 0 and s["decode_offload_evictions"] == 0
    assert s["total_prefill_tokens"] == sum(LENS)  # only the prompts were ever prefilled
    assert s["decode_offload_capacity_tokens"] == 4096 and s["decode_offload_used_tokens"] == 0


def test_without_the_store_retracted_requests_recompute(tiny_model_dir, vocab, reference):
    got, s = _run(tiny_model_dir, vocab, decode_offload_size=0, **TINY)
    assert got == reference
    assert s["num_retractions"] > 0 and s["num_retract_recomputed"] == s["num_retractions"]
    assert s["num_retract_restored"] == s["num_retract_offloaded"] == 0
    assert s["total_prefill_tokens"] > sum(LENS)
    assert s["decode_offload_capacity_tokens"] == 0


def test_a_small_store_evicts_and_the_rest_recompute(tiny_model_dir, vocab, reference):
    got, s = _run(tiny_model_dir, vocab, decode_offload_size=48, **TINY)
    assert got == reference
    assert s["num_retract_restored"] > 0 and s["num_retract_recomputed"] > 0
    assert s["num_retract_restored"] + s["num_retract_recomputed"] == s["num_retractions"]
    assert s["decode_offload_evictions"] + s["decode_offload_rejected"] > 0


def test_an_aborted_retracted_request_leaves_nothing_in_the_store(tiny_model_dir, vocab):
    eng = Engine(tiny_model_dir, decode_offload_size=4096, **TINY)
    for i, p in enumerate(prompts_of(LENS, vocab, seed=11)):
        eng.submit(f"r{i}", p, max_new=MAX_NEW)
    s = eng.sched
    for _ in range(500):
        out = s.schedule()
        eng.sched.emit(s.update_from_output(out, s.runner.run(out.batch) if out.batch is not None else None))
        if out.retracted:
            break
    victim = out.retracted[0]
    assert victim in s.host_store
    s.abort_request(victim)
    assert victim not in s.host_store
    s.abort_request("")
    eng.updates()
    eng.assert_restored()
    assert len(s.host_store) == 0 and s.host_store.used_tokens() == 0
