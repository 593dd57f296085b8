"""EPLB's placement rule on recorded loads, the placement's split of pairs between copies, and the expert
figures in the metrics."""

from __future__ import annotations

import torch

from common.layers.eplb import imbalance, plan
from common.layers.moe import ExpertPlacement
from common.server.metrics import Metrics


def test_hot_expert_gets_copies_on_the_other_ranks():
    # 8 experts on 4 EP ranks (2 each) with one spare slot per rank; expert 0 takes most of the pairs
    load = [800, 10, 10, 10, 10, 10, 10, 10]
    replicas = plan(load, ep_size=4, per_rank=2, slots=3)
    assert replicas[0][0] == (0, 0), "the home copy stays first"
    assert {r for r, _ in replicas[0]} == {0, 1, 2, 3}, "one copy per rank, at most"
    assert all(len(replicas[e]) == 1 for e in range(1, 8))
    assert imbalance(load, replicas, 4) < 1.1 < imbalance(load, plan(load, 4, 2, 2), 4)


def test_copies_go_to_the_least_loaded_rank():
    load = [100, 90, 5, 5]  # both hot experts on rank 0 of 2
    replicas = plan(load, ep_size=2, per_rank=2, slots=3)
    assert replicas[0] == [(0, 0), (1, 2)] and replicas[1] == [(0, 1)]
    assert imbalance(load, replicas, 2) < imbalance(load, [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]], 2)


def test_even_load_places_no_copy():
    """A copy of an expert on an evenly loaded rank would only move load onto it: none is placed."""
    load = [50] * 4
    replicas = plan(load, 2, 2, 3)
    assert all(len(r) == 1 for r in replicas), replicas
    assert imbalance(load, replicas, 2) == 1.0


def test_pairs_split_between_copies_exactly_once():
    p = ExpertPlacement(4, ep_size=2, redundant_per_rank=1)
    p.set([[(0, 0), (1, 2)], [(0, 1)], [(1, 0)], [(1, 1)]])
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [3, 0]])
    seen = set()
    for rank in (0, 1):
        tok, choice, slot = p.mine(ids, rank)
        for t, c, s in zip(tok.tolist(), choice.tolist(), slot.tolist(), strict=True):
            assert (t, c) not in seen
            seen.add((t, c))
            e = ids[t, c].item()
            assert (rank, s) in p.replicas[e]
    assert seen == {(t, c) for t in range(4) for c in range(2)}
    tok, _, slot = p.mine(ids, 1)
    assert (1, 2) in zip(tok.tolist(), slot.tolist(), strict=True), "token 1's expert-0 pair on the copy"


def test_metrics_show_expert_load():
    m = Metrics("tiny")
    m.set_stats({"moe_expert_load": {"layers.0": [6, 2, 0, 0], "layers.1": [2, 2, 2, 2]},
                 "moe_eplb_rebalances": 3})
    text = m.render()
    assert 'pdserve_moe_expert_tokens_total{expert="0",model_name="tiny"} 8.0' in text
    assert 'pdserve_moe_expert_load_imbalance{layer="layers.0",model_name="tiny"} 3.0' in text
    assert 'pdserve_moe_expert_load_imbalance{layer="layers.1",model_name="tiny"} 1.0' in text
    assert "pdserve_moe_eplb_rebalances_total" in text
