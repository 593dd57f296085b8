"""`pdserve bench dp-attention` (bench/dp_attention.py): its ratios set DP attention against TP attention and
against independent groups, and it refuses setups it does not know. DP attention itself:
tests/integration/test_dp_attention.py, tests/pd/test_pd_dp_attention.py."""

from __future__ import annotations

from bench import dp_attention


def test_ratios_set_dp_attention_against_each_reference():
    tp = {"output_throughput": 40.0, "tpot_ms": {"p50": 90.0}}
    dpa = {"output_throughput": 50.0, "tpot_ms": {"p50": 60.0}}
    dp = {"output_throughput": 100.0, "tpot_ms": {"p50": 30.0}}
    assert dp_attention.compute_ratios({"tp_ep": tp, "dp_attention": dpa, "dp": dp}) == {
        "dpa_vs_tp_output_throughput": 1.25, "dpa_vs_tp_tpot_p50": 1.5, "dpa_vs_dp_output_throughput": 0.5}
    assert dp_attention.compute_ratios({"tp_ep": tp}) == {}


def test_unknown_setups_are_refused():
    assert dp_attention.main(["--setups", "tp_ep,dp8"]) == 2 and dp_attention.main(["--setups", ""]) == 2


def test_the_model_splits_over_two_ranks_either_way():
    cfg = dp_attention.MODEL
    assert cfg["num_key_value_heads"] % 2 == 0 and cfg["num_experts"] % 2 == 0
