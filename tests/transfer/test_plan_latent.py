"""A replicated KV head through the region planner: the single-plane latent pool of multi-head latent
attention (one head, on every TP rank) moved between any prefill and decode TP sizes. Every decode rank
gets the whole latent; the prefill replicas of the head each send their share of its bytes, so every byte
reaches each decode rank once."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from common.memory.kv_pool import KVPool
from transfer.base import KVArgs
from transfer.control import peer_registration
from transfer.plan import PairPlan, head_range, heads_per_rank, ranks_overlapping, replica_share


def test_replicated_head_ranges():
    assert heads_per_rank(1, 4) == 1 and heads_per_rank(2, 4) == 1 and heads_per_rank(8, 4) == 2
    assert heads_per_rank(3, 4) is None and heads_per_rank(6, 4) is None
    assert [head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [replica_share(r, 4, 2) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert replica_share(1, 2, 4) == (0, 1)
    assert ranks_overlapping(0, 1, 1, 2) == [0, 1]  # the latent: both prefill replicas send to a rank
    assert ranks_overlapping(1, 2, 2, 4) == [2, 3]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_latent_pages_reach_every_decode_rank_once(prefill_tp, decode_tp):
    layers, pages, page_size, dim = 3, 10, 4, 10
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn((pages, 1, layers, 1, page_size, dim), generator=gen)
    prefill = [KVPool(pages, page_size, layers, 1, dim, shared_kv=True) for _ in range(prefill_tp)]
    decode = [KVPool(pages, page_size, layers, 1, dim, shared_kv=True) for _ in range(decode_tp)]
    for p in prefill:
        p.data.copy_(latent)
    s, t = np.array([2, 3, 7], dtype=np.int64), np.array([5, 6, 1], dtype=np.int64)
    moved = [0] * decode_tp
    for r, p in enumerate(prefill):
        pa = KVArgs.from_pool(p, engine_rank=r, tp_size=prefill_tp, total_kv_heads=1)
        for q, d in enumerate(decode):
            da = KVArgs.from_pool(d, engine_rank=q, tp_size=decode_tp, total_kv_heads=1)
            src, dst, lens = PairPlan(pa, peer_registration(da, "decode", b"")).kv_regions(s, t)
            for a, b, n in zip(src, dst, lens, strict=True):
                ctypes.memmove(b, a, n)
                moved[q] += n
    per_page = layers * page_size * dim * 4
    assert moved == [len(s) * per_page] * decode_tp  # the latent rows once per decode rank, no more
    for d in decode:
        want = torch.zeros_like(latent)
        want[t] = latent[s]
        assert torch.equal(d.data, want)
