"""The automatic placement of `pdserve cluster` (deploy/placement.py): which cores each node gets."""

from __future__ import annotations

import pytest

from deploy.placement import plan


def test_two_cores_one_prefill_one_decode_get_a_core_each(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    p = plan(1, 1, [1, 0])
    assert p.cores == {"prefill-0": [0], "decode-0": [1]} and not p.shared
    assert p.env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert p.describe() == ("placement (a core set per node; OMP_WAIT_POLICY=PASSIVE; router unpinned): "
                            "prefill-0 on core 0 (1 thread), decode-0 on core 1 (1 thread); decode-0 borrows "
                            "prefill-0's core 0 while prefill-0 has nothing to run (GOMP_SPINCOUNT=10000)")
    assert p.loans == {"decode-0": "prefill-0"}
    assert p.node_env("decode-0") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
    assert p.node_env("prefill-0") == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_decode_node_i_borrows_prefill_node_i_and_never_on_shared_cores():
    assert plan(2, 1, list(range(4))).loans == {"decode-0": "prefill-0"}
    assert plan(1, 3, list(range(8))).loans == {"decode-0": "prefill-0"}  # a lender lends to one borrower
    assert plan(2, 2, list(range(4))).loans == {"decode-0": "prefill-0", "decode-1": "prefill-1"}
    assert plan(2, 2, [0, 1]).loans == {}  # shared round-robin: nothing of its own to lend
    p = plan(1, 1, [0, 1], loans=False)
    assert p.loans == {} and "borrows" not in p.describe() and p.node_env("decode-0") == p.env


def test_blocks_are_contiguous_and_leftovers_go_to_prefill_nodes_first():
    assert plan(1, 1, list(range(8))).cores == {"prefill-0": [0, 1, 2, 3], "decode-0": [4, 5, 6, 7]}
    assert plan(1, 2, [0, 1, 2, 3]).cores == {"prefill-0": [0, 1], "decode-0": [2], "decode-1": [3]}
    assert plan(2, 1, list(range(7))).cores == {"prefill-0": [0, 1, 2],
                                                "prefill-1": [3, 4], "decode-0": [5, 6]}
    # more leftovers than prefill nodes: the next go to decode nodes
    assert plan(1, 3, list(range(7))).cores == {"prefill-0": [0, 1], "decode-0": [2, 3], "decode-1": [4, 5],
                                                "decode-2": [6]}
    p = plan(2, 2, [2, 3, 5, 7, 11, 13])
    assert sorted(c for cs in p.cores.values() for c in cs) == [2, 3, 5, 7, 11, 13]  # every core, once
    assert "prefill-0 on cores 2-3 (2 threads)" in p.describe()


def test_fewer_cores_than_nodes_share_round_robin_with_one_thread_each():
    p = plan(2, 2, [0, 1])
    assert p.shared and p.cores == {"prefill-0": [0], "prefill-1": [1], "decode-0": [0], "decode-1": [1]}
    assert "fewer cores than nodes: shared round-robin" in p.describe()


def test_a_wait_policy_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert plan(1, 1, [0, 1]).env == {}
    assert "environment unchanged" in plan(1, 1, [0, 1]).describe()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        plan(1, 1, [])
    with pytest.raises(ValueError):
        plan(-1, 1, [0])
    assert plan(0, 0, [0]).cores == {}
