"""`pdserve bench pp` (bench/pp.py): its ratios set the pipelined setups against one stage, and it
refuses settings it cannot run. PP serving itself: tests/pd/test_pd_pp.py."""

from __future__ import annotations

from bench import pp


def test_bench_pp_ratios_and_refusals():
    one = {"ttft_ms": {"p50": 2400.0}, "input_throughput": 720.0}
    two = {"ttft_ms": {"p50": 3000.0}, "input_throughput": 576.0}
    seq = {"ttft_ms": {"p50": 4500.0}, "input_throughput": 380.0}
    assert pp.compute_ratios({"pp1": one, "pp2": two, "pp2_sequential": seq}, "pp2") == {
        "pp_ttft_p50": 0.8, "pp_input_throughput": 0.8, "pp_microbatch_ttft_p50": 1.5}
    assert pp.compute_ratios({"pp2": two}, "pp2") == {}
    assert pp.main(["--pp-size", "1"]) == 2 and pp.main(["--setups", "pp9"]) == 2
