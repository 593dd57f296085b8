"""Scheduling decisions without a model: PrefillAdder budgets, chunking, LPM order, the
new_token_ratio schedule, retraction (real pools and a real radix cache)."""

from __future__ import annotations

import pytest
import torch

from common.config import ServerArgs
from common.forward_batch import ForwardMode
from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.kv_pool import KVPool
from common.memory.radix_cache import RadixCache
from common.memory.req_to_token import ReqToTokenPool
from common.protocol import SamplingParams
from common.scheduler.batch import ScheduleBatch
from common.scheduler.policy import NewTokenRatio, SchedulePolicy
from common.scheduler.prefill_adder import AddResult, PrefillAdder
from common.scheduler.priority import PriorityScheduling
from common.scheduler.req import Req

PS = 4


class Pools:
    def __init__(self, pages=65, rows=8):
        self.alloc = TokenToKVPoolAllocator(pages, PS)
        self.pool = ReqToTokenPool(rows, 512)
        self.kv = KVPool(pages, PS, num_layers=1, kv_heads=1, head_dim=2)
        self.tree = RadixCache(self.pool, self.alloc, PS)

    def batch(self, reqs):
        return ScheduleBatch(reqs, self.pool, self.alloc, self.kv, self.tree)

    def adder(self, running=(), ratio=0.5, max_prefill=10_000, chunk=-1):
        return PrefillAdder(self.tree, self.alloc, list(running), ratio, max_prefill, chunk)

    def start(self):
        return self.alloc.available_pages(), self.pool.available_size()

    def free_counts(self):
        return (self.alloc.available_pages() + self.tree.evictable_size() // PS, self.pool.available_size())


def req(n, max_new=8, rid="r", base=0):
    return Req(rid, [base + i for i in range(n)], SamplingParams(max_new_tokens=max_new, temperature=0))


def admit(p: Pools, reqs, **kw):
    adder = p.adder(**kw)
    results = []
    for r in reqs:
        r.init_next_round_input(p.tree)
        res = adder.add_one_req(r)
        results.append(res)
        if res is not AddResult.CONTINUE:
            break
    return adder, results


def test_total_budget_counts_running_reservations():
    p = Pools(pages=65)  # 256 tokens
    # two running requests, each with 100 tokens still to generate, reserve 100 * 0.5 each
    running = [req(4, max_new=100, rid=f"run{i}") for i in range(2)]
    adder = p.adder(running=running, ratio=0.5)
    assert adder.rem_total_tokens == 256 - 100
    # a request of 40 prompt + 60 output tokens fits, a second one does not
    a, b = req(40, max_new=60, rid="a"), req(40, max_new=60, rid="b", base=1000)
    for r in (a, b):
        r.init_next_round_input(p.tree)
    assert adder.add_one_req(a) is AddResult.CONTINUE
    assert adder.rem_total_tokens == 156 - 100
    assert adder.add_one_req(b) is AddResult.NO_TOKEN
    assert adder.can_run_list == [a]
    # the decayed ratio reserves less
    assert p.adder(running=running, ratio=0.1).rem_total_tokens == 256 - 20


def test_input_budget_stops_after_first_request():
    p = Pools()
    reqs = [req(30, rid=f"r{i}", base=100 * i) for i in range(3)]
    adder, results = admit(p, reqs, max_prefill=50)
    # the first is always admitted; the second would exceed max_prefill_tokens
    assert [r.rid for r in adder.can_run_list] == ["r0"]
    assert results[-1] is AddResult.OTHER


def test_chunking_is_page_aligned_and_single():
    p = Pools()
    long1, long2 = req(50, rid="l1"), req(50, rid="l2", base=500)
    adder, results = admit(p, [long1, long2], chunk=18)
    assert adder.can_run_list == [long1] and adder.new_chunked_req is long1
    assert long1.extend_input_len == 16  # 18 rounded down to the page size
    assert results == [AddResult.OTHER]
    # the chunked request continues: 16 more, then the last 18 (fits the chunk exactly)
    batch = p.batch([long1])
    batch.prepare_for_extend()
    p.tree.cache_unfinished_req(long1)
    for expect_len, expect_more in ((16, True), (18, False)):
        a2 = p.adder(chunk=18)
        long1.init_next_round_input(p.tree)
        a2.add_chunked_req(long1)
        assert long1.extend_input_len == expect_len
        assert (a2.new_chunked_req is long1) == expect_more
        p.batch([long1]).prepare_for_extend()
        p.tree.cache_unfinished_req(long1)
    assert long1.kv_len == 50
    p.tree.cache_finished_req(long1)


def test_chunk_budget_shared_by_requests():
    p = Pools()
    a, b = req(10, rid="a"), req(30, rid="b", base=300)
    adder, _ = admit(p, [a, b], chunk=24)
    # a takes 10; b gets what is left of the chunk budget (14 -> 12 page aligned)
    assert adder.can_run_list == [a, b] and b.extend_input_len == 12 and adder.new_chunked_req is b


def test_prefix_hit_shrinks_extend_and_is_locked():
    p = Pools()
    first = req(20, rid="first")
    adder, _ = admit(p, [first])
    b = p.batch(adder.can_run_list)
    b.prepare_for_extend()
    first.output_ids = [1]
    p.tree.cache_finished_req(first)
    assert p.tree.evictable_size() == 20
    second = req(26, rid="second")  # shares the first 20 tokens
    adder, _ = admit(p, [second])
    assert len(second.prefix_indices) == 20 and second.extend_input_len == 6
    assert second.cached_tokens == 20
    assert p.tree.protected_size() == 20 and p.tree.evictable_size() == 0
    b = p.batch([second])
    fb = b.prepare_for_extend()
    assert fb.extend_prefix_lens == [20] and fb.extend_seq_lens == [6] and fb.positions.tolist()[0] == 20
    assert fb.req_to_token[second.req_pool_idx, :20].tolist() == second.prefix_indices.tolist()
    p.tree.cache_finished_req(second)


def test_prefix_match_leaves_one_token_to_compute():
    p = Pools()
    a = req(16, rid="a")
    admit(p, [a])
    p.batch([a]).prepare_for_extend()
    p.tree.cache_finished_req(a)
    again = req(16, rid="again")
    again.init_next_round_input(p.tree)
    # the whole prompt is cached, but the last token must run to give logits: one page less
    assert len(again.prefix_indices) == 12 and again.extend_input_len == 4


def test_lpm_orders_by_cached_prefix():
    p = Pools()
    warm = req(24, rid="warm", base=1000)
    admit(p, [warm])
    p.batch([warm]).prepare_for_extend()
    p.tree.cache_finished_req(warm)
    cold = req(24, rid="cold")
    hot = req(30, rid="hot", base=1000)
    queue = [cold, hot]
    prio = PriorityScheduling(ServerArgs())
    SchedulePolicy("fcfs", p.tree, prio).calc_priority(queue)
    assert [r.rid for r in queue] == ["cold", "hot"]
    SchedulePolicy("lpm", p.tree, prio).calc_priority(queue)
    assert [r.rid for r in queue] == ["hot", "cold"]
    cold.priority = 1  # a priority comes before the cached prefix
    SchedulePolicy("lpm", p.tree, prio).calc_priority(queue)
    assert [r.rid for r in queue] == ["cold", "hot"]
    with pytest.raises(ValueError):
        SchedulePolicy("random", p.tree, prio)


def test_new_token_ratio_decay_and_retract_bump():
    r = NewTokenRatio(0.7, 0.1, 6)
    vals = []
    for _ in range(8):
        r.decay()
        vals.append(round(r.value, 6))
    assert vals[:6] == [0.6, 0.5, 0.4, 0.3, 0.2, 0.1] and vals[6:] == [0.1, 0.1]
    r.on_retract(0.45)
    assert r.value == 0.45
    r.on_retract(3.0)
    assert r.value == 1.0


def _run_prefill(p: Pools, reqs, outputs):
    b = p.batch(list(reqs))
    b.prepare_for_extend()
    for r, out in zip(reqs, outputs, strict=True):
        r.output_ids = list(out)
    return b


def test_prepare_for_decode_allocates_at_page_boundaries():
    p = Pools()
    a, b = req(7, rid="a"), req(8, rid="b", base=100)
    for r in (a, b):
        r.init_next_round_input(p.tree)
    batch = _run_prefill(p, [a, b], [[5], [6]])
    pages = p.alloc.available_pages()
    fb = batch.prepare_for_decode()
    assert fb.mode == ForwardMode.DECODE
    assert fb.input_ids.tolist() == [5, 6] and fb.positions.tolist() == [7, 8] and fb.seq_lens == [8, 9]
    assert p.alloc.available_pages() == pages - 1  # only b crossed into a new page
    assert fb.out_cache_loc[0] == fb.req_to_token[a.req_pool_idx, 6] + 1
    assert fb.out_cache_loc[1] % PS == 0
    for r in (a, b):
        p.tree.cache_finished_req(r)


def test_retraction_picks_fewest_outputs_and_frees():
    p = Pools(pages=11)  # 40 tokens
    start = p.start()
    lens = [8, 8, 8, 12]
    reqs = [req(n, max_new=30, rid=f"r{i}", base=100 * i) for i, n in enumerate(lens)]
    for r in reqs:
        r.init_next_round_input(p.tree)
    batch = _run_prefill(p, reqs, [[1] * 3, [1], [1] * 2, [1]])
    # every request is at a page boundary: the next decode step needs 4 pages, 1 is free
    assert p.alloc.available_pages() == 1
    assert not batch.check_decode_mem()
    victims, ratio = batch.retract_decode()
    # fewest output tokens first, ties: longest prompt -> r3 (1 output, 12 tokens) before r1;
    # its 3 pages go to the radix cache (evictable), which is enough for the other three
    assert [v.rid for v in victims] == ["r3"]
    assert [r.rid for r in batch.reqs] == ["r0", "r1", "r2"]
    assert batch.check_decode_mem()
    v = victims[0]
    assert v.req_pool_idx is None and v.is_retracted and v.fill_ids == v.origin_input_ids + v.output_ids
    assert 0 < ratio <= 1
    assert p.tree.evictable_size() == 12
    # a re-prefill now would reuse the cached pages (prompt + output is 13 tokens: 12 cached)
    v.init_next_round_input(p.tree)
    assert len(v.prefix_indices) == 12 and v.extend_input_len == 1
    batch.prepare_for_decode()  # evicts what it needs
    assert p.tree.evictable_size() == 0
    for r in batch.reqs:
        p.tree.cache_finished_req(r)
    p.tree.evict(10**6)
    assert p.start() == start


def test_retraction_of_everything_when_memory_is_held_elsewhere():
    p = Pools(pages=5)  # 16 tokens
    a = req(8, max_new=30, rid="a")
    a.init_next_round_input(p.tree)
    batch = _run_prefill(p, [a], [[1]])
    hog = p.alloc.alloc_pages(2)  # e.g. a chunked prefill holding the rest
    victims, _ = batch.retract_decode()
    assert victims == [a] and batch.is_empty()
    p.alloc.free_pages(hog)
    p.tree.evict(10**6)
    assert p.alloc.available_pages() == 4 and p.pool.available_size() == 8


def test_filter_and_merge():
    p = Pools()
    a, b, c = (req(4, rid=x, base=10 * i) for i, x in enumerate("abc"))
    batch = p.batch([a, b])
    batch.merge(p.batch([c]))
    assert [r.rid for r in batch.reqs] == ["a", "b", "c"]
    batch.filter(lambda r: r.rid != "b")
    assert [r.rid for r in batch.reqs] == ["a", "c"] and len(batch) == 2


def test_input_logprob_rows_in_extend():
    p = Pools()
    r = Req("lp", list(range(10)), SamplingParams(max_new_tokens=2), return_logprob=True, logprob_start_len=3)
    r.init_next_round_input(p.tree)
    fb = p.batch([r]).prepare_for_extend()
    # positions 2..9 give logits: 2..8 for prompt tokens 3..9, 9 for the first output token
    assert fb.logits_indices.tolist() == list(range(2, 10))
    assert torch.equal(fb.input_ids, torch.arange(10))
    p.tree.cache_finished_req(r)


# ------------------------------------------------------------------------------------------------
# check_finished


def _fin(sp: SamplingParams, out, eos=(2,), tokenizer=None):
    r = Req("f", [1, 2, 3], sp, eos_token_ids=list(eos), tokenizer=tokenizer)
    r.output_ids = list(out)
    r.check_finished()
    return r.finished_reason


def test_check_finished_token_rules():
    assert _fin(SamplingParams(max_new_tokens=3), [5, 6]) is None
    assert _fin(SamplingParams(max_new_tokens=3), [5, 6, 7]) == {"type": "length", "length": 3}
    assert _fin(SamplingParams(max_new_tokens=9), [5, 2]) == {"type": "stop", "matched": 2}
    assert _fin(SamplingParams(max_new_tokens=9, ignore_eos=True), [5, 2]) is None
    assert _fin(SamplingParams(max_new_tokens=9, ignore_eos=True, stop_token_ids=[7]), [5, 7]) == {
        "type": "stop", "matched": 7}
    # the length limit wins when both apply (SGLang's order)
    assert _fin(SamplingParams(max_new_tokens=2), [5, 2]) == {"type": "length", "length": 2}
    # no stop before min_new_tokens
    assert _fin(SamplingParams(max_new_tokens=9, min_new_tokens=3), [5, 2]) is None
    r = Req("a", [1], SamplingParams(max_new_tokens=9))
    r.to_abort = "client went away"
    assert r.check_finished() and r.finished_reason == {"type": "abort", "message": "client went away"}


def test_check_finished_stop_strings(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok("hello world, the quick brown fox", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_new_tokens=99, stop=["quick br", "zzzz"])
    # the stop string completes at some token: not finished before it, finished at it
    done_at = None
    for n in range(1, len(ids) + 1):
        if _fin(sp, ids[:n], tokenizer=tok) is not None:
            done_at = n
            break
    assert done_at is not None
    assert "quick br" in tok.decode(ids[:done_at]) and "quick br" not in tok.decode(ids[: done_at - 1])
    assert _fin(sp, ids[:done_at], tokenizer=tok) == {"type": "stop", "matched": "quick br"}
