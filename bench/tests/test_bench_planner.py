"""`pdserve bench planner` (bench/planner.py): its ratios set the planner against the best and the worst fixed
split, every setup gets the same requests at the same times, and bad phases or setups are refused. The
role switch itself: tests/pd/test_pd_role_switch.py; the planner's rule: tests/router/test_slo_rule.py."""

from __future__ import annotations

import pytest

from bench import planner, slo
from bench.serve import PromptMaker, RequestResult


def test_ratios_against_the_best_and_the_worst_fixed_split():
    att = {"planner": 0.9, "fixed_3p1d": 0.5, "fixed_2p2d": 0.75, "fixed_1p3d": 0.6}
    r = planner.compute_ratios(att)
    assert r == pytest.approx({"planner_vs_best_fixed": 1.2, "planner_vs_worst_fixed": 1.8})
    assert planner.compute_ratios({"planner": 0.9}) == {}
    assert planner.compute_ratios({"planner": 0.9, "fixed_2p2d": 0.0}) == {}


def test_attainment_needs_both_slos_and_an_answer():
    fast = RequestResult(ok=True, tag="t", prompt_len=8, output_len=11, ttft=0.5, latency=1.5)  # tpot 0.1
    slow_first = RequestResult(ok=True, tag="t", prompt_len=8, output_len=11, ttft=2.5, latency=3.0)
    slow_tokens = RequestResult(ok=True, tag="t", prompt_len=8, output_len=11, ttft=0.5, latency=4.0)
    failed = RequestResult(ok=False, tag="t", prompt_len=8)
    assert slo.attainment([fast, slow_first, slow_tokens, failed], 2000, 100) == 0.25  # the planner's measure


def test_every_setup_gets_the_same_phased_requests():
    phases = planner.parse_phases("prompt:5:4:64:4,output:5:2:8:16")
    maker = PromptMaker(None, 0)
    a, b = planner.build_requests(phases, maker, 1), planner.build_requests(phases, PromptMaker(None, 0), 1)
    assert [(r.send_at, r.tag, r.output_len) for r in a] == [(r.send_at, r.tag, r.output_len) for r in b]
    assert {r.tag for r in a} == {"0-prompt", "1-output"}
    assert all(r.send_at < 5 for r in a if r.tag == "0-prompt") and all(5 <= r.send_at < 10 for r in a
                                                                         if r.tag == "1-output")
    for bad in ("prompt:0:4:64:4", "prompt:5:4:64", "prompt:5:4:64:1", ""):
        with pytest.raises(ValueError):
            planner.parse_phases(bad)


def test_unknown_setups_and_phases_are_refused():
    assert planner.main(["--setups", "planner,fixed_4p0d"]) == 2
    assert planner.main(["--phases", "prompt:5"]) == 2
