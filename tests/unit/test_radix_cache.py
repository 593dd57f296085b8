"""RadixCache on real pools: page-aligned matching, ownership of inserted pages, locks, LRU eviction."""

from __future__ import annotations

import time

import torch

from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.radix_cache import ChunkCache, RadixCache
from common.memory.req_to_token import ReqToTokenPool
from common.protocol import SamplingParams
from common.scheduler.req import Req

PS = 4


def make(num_pages=33, ps=PS):
    alloc = TokenToKVPoolAllocator(num_pages, ps)
    pool = ReqToTokenPool(4, 256)
    return alloc, pool, RadixCache(pool, alloc, ps)


def slots_for(alloc, n):
    return alloc.alloc_extend(0, 0, n)


def test_only_full_pages_are_cached_and_matched():
    alloc, _, tree = make()
    toks = list(range(100, 110))  # 10 tokens: 2 full pages
    s = slots_for(alloc, 10)
    assert tree.insert(toks, s) == 0
    assert tree.evictable_size() == 8
    got, node = tree.match_prefix(toks)
    assert got.tolist() == s[:8].tolist()
    # a query shorter than a page matches nothing; 7 tokens match one page
    assert tree.match_prefix(toks[:3])[0].numel() == 0
    assert tree.match_prefix(toks[:7])[0].tolist() == s[:4].tolist()
    # diverging inside the second page: only the first page matches
    q = toks[:5] + [1, 2, 3]
    assert tree.match_prefix(q)[0].tolist() == s[:4].tolist()
    # the caller keeps the tail page: free it; then evicting everything restores the allocator
    alloc.free_slots(s[8:])
    assert tree.evict(100) == 8
    assert alloc.available_pages() == 32 and tree.evictable_size() == 0


def test_split_and_branch():
    alloc, _, tree = make()
    a = list(range(16))
    b = list(range(8)) + [50 + i for i in range(8)]
    sa = slots_for(alloc, 16)
    tree.insert(a, sa)
    sb = slots_for(alloc, 16)
    assert tree.insert(b, sb) == 8  # the shared 2 pages were already cached
    # b's duplicate pages for the shared prefix went back to the allocator at once
    assert alloc.available_pages() == 32 - 4 - 2
    assert tree.evictable_size() == 24
    ga, _ = tree.match_prefix(a)
    gb, _ = tree.match_prefix(b)
    assert ga.tolist() == sa.tolist()
    assert gb[:8].tolist() == sa[:8].tolist() and gb[8:].tolist() == sb[8:].tolist()
    tree.evict(1000)
    assert alloc.available_pages() == 32


def test_insert_of_tree_owned_slots_frees_nothing():
    alloc, _, tree = make()
    toks = list(range(12))
    s = slots_for(alloc, 12)
    tree.insert(toks, s)
    free = alloc.available_pages()
    got, _ = tree.match_prefix(toks)
    assert tree.insert(toks + [99] * 4, torch.cat([got, slots_for(alloc, 4)])) == 12
    assert alloc.available_pages() == free - 1  # only the new page was taken (by the tree)
    assert tree.evictable_size() == 16


def test_lock_protects_from_eviction():
    alloc, _, tree = make()
    a, b = list(range(8)), list(range(20, 28))
    tree.insert(a, slots_for(alloc, 8))
    tree.insert(b, slots_for(alloc, 8))
    _, node_a = tree.match_prefix(a)
    assert tree.inc_lock_ref(node_a) == 8
    assert tree.protected_size() == 8 and tree.evictable_size() == 8
    assert tree.evict(100) == 8  # only b
    assert tree.match_prefix(a)[0].numel() == 8 and tree.match_prefix(b)[0].numel() == 0
    assert tree.dec_lock_ref(node_a) == 8
    assert tree.protected_size() == 0 and tree.evictable_size() == 8
    tree.evict(100)
    assert alloc.available_pages() == 32


def test_lock_on_split_node_is_kept():
    alloc, _, tree = make()
    a = list(range(16))
    tree.insert(a, slots_for(alloc, 16))
    _, node = tree.match_prefix(a)
    tree.inc_lock_ref(node)
    # splitting the locked edge keeps both halves locked
    tree.match_prefix(a[:8])
    assert tree.evict(100) == 0
    tree.dec_lock_ref(node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 16
    assert tree.evict(100) == 16


def test_lru_eviction_order():
    alloc, _, tree = make()
    a, b, c = list(range(8)), list(range(20, 28)), list(range(40, 48))
    for t in (a, b, c):
        tree.insert(t, slots_for(alloc, 8))
        time.sleep(0.002)
    tree.match_prefix(a)  # a is now the most recently used
    assert tree.evict(8) == 8
    assert tree.match_prefix(b)[0].numel() == 0
    assert tree.match_prefix(a)[0].numel() == 8 and tree.match_prefix(c)[0].numel() == 8
    # evicting a leaf makes its parent a leaf, which can go next
    tree.insert(a + [1, 2, 3, 4], torch.cat([tree.match_prefix(a)[0], slots_for(alloc, 4)]))
    assert tree.evict(1000) == 20
    assert alloc.available_pages() == 32 and tree.total_size() == 0


def _req(tokens, out=()):
    r = Req("r", tokens, SamplingParams(max_new_tokens=8))
    r.output_ids = list(out)
    return r


def _give_kv(alloc, pool, req, prefix, node, n):
    """What ScheduleBatch.prepare_for_extend does: a row, the prefix slots, new slots."""
    row = pool.alloc()
    req.req_pool_idx = row
    pool.write(row, 0, prefix)
    pre = prefix.numel()
    last = int(prefix[-1]) if pre else 0
    pool.write(row, pre, alloc.alloc_extend(pre, last, n))
    req.kv_len = pre + n
    req.prefix_indices, req.last_node, req.locked_len = prefix, node, pre


def test_cache_finished_and_unfinished_req_restore_free_counts():
    alloc, pool, tree = make()
    start_pages, start_rows = alloc.available_pages(), pool.available_size()
    prompt = list(range(30))  # 7 full pages + 2 tokens
    # first chunk of 16 tokens (chunked prefill), then cache what was computed
    r = _req(prompt)
    _give_kv(alloc, pool, r, torch.empty(0, dtype=torch.int64), None, 16)
    own_first = pool.slots(r.req_pool_idx, 0, 16).clone()
    tree.cache_unfinished_req(r)
    assert r.locked_len == 16 and tree.protected_size() == 16 and tree.evictable_size() == 0
    assert pool.slots(r.req_pool_idx, 0, 16).tolist() == own_first.tolist()
    # second chunk: continue from the held prefix
    row = r.req_pool_idx
    pool.write(row, 16, alloc.alloc_extend(16, int(own_first[-1]), 14))
    r.kv_len = 30
    # a second request with the same prompt arrives and hits the first 16 tokens
    r2 = _req(prompt)
    pre, node = tree.match_prefix(prompt[:29])
    assert pre.numel() == 16
    tree.inc_lock_ref(node)
    _give_kv(alloc, pool, r2, pre, node, 14)
    r.output_ids = [7]
    tree.cache_finished_req(r)  # inserts 28 tokens (7 pages); frees the partial page
    assert r.req_pool_idx is None and r.last_node is None
    used_by_r2 = 4  # r2's own pages: 3 full + 1 partial
    assert alloc.available_pages() == start_pages - 7 - used_by_r2
    tree.cache_finished_req(r2)  # its 3 full pages duplicate r's: freed; its partial page freed
    assert alloc.available_pages() == start_pages - 7
    assert tree.protected_size() == 0 and tree.evictable_size() == 28
    assert pool.available_size() == start_rows
    tree.evict(10**6)
    assert alloc.available_pages() == start_pages


def test_release_req_keeps_tree_pages():
    alloc, pool, tree = make()
    start = alloc.available_pages()
    toks = list(range(8))
    tree.insert(toks, slots_for(alloc, 8))
    r = _req(toks + [1, 2, 3, 4, 5])
    pre, node = tree.match_prefix(r.fill_ids[:12])
    tree.inc_lock_ref(node)
    _give_kv(alloc, pool, r, pre, node, 5)
    tree.release_req(r)
    assert alloc.available_pages() == start - 2 and tree.evictable_size() == 8
    tree.flush()
    assert alloc.available_pages() == start and tree.total_size() == 0


def test_chunk_cache_reuses_nothing():
    alloc = TokenToKVPoolAllocator(9, PS)
    pool = ReqToTokenPool(2, 64)
    cache = ChunkCache(pool, alloc, PS)
    r = _req(list(range(10)))
    assert cache.match_prefix(r.fill_ids)[0].numel() == 0
    _give_kv(alloc, pool, r, torch.empty(0, dtype=torch.int64), None, 6)
    cache.cache_unfinished_req(r)
    assert r.prefix_indices.numel() == 6
    cache.cache_finished_req(r)
    assert alloc.available_pages() == 8 and pool.available_size() == 2 and cache.evictable_size() == 0
