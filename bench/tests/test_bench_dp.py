"""`pdserve bench dp` (bench/dp.py): its ratios set the DP setup against one group, and it refuses
settings it cannot run. DP serving itself: tests/pd/test_pd_dp.py."""

from __future__ import annotations

from bench import dp


def test_bench_dp_ratios_are_dp_over_one_group():
    one = {"output_throughput": 40.0, "tpot_ms": {"p50": 90.0}, "ttft_ms": {"p99": 800.0}}
    two = {"output_throughput": 60.0, "tpot_ms": {"p50": 60.0}, "ttft_ms": {"p99": 1000.0}}
    assert dp.compute_ratios({"dp1": one, "dp2": two}, "dp2") == {
        "dp_output_throughput": 1.5, "dp_tpot_p50": 1.5, "dp_ttft_p99": 0.8}
    assert dp.compute_ratios({"dp2": two}, "dp2") == {}
    assert dp.main(["--dp-size", "1"]) == 2 and dp.main(["--setups", "dp3"]) == 2
