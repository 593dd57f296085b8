"""`pdserve bench moe` (bench/moe.py), the short version: a small block against the per-expert loop and
transformers, and EPLB on two gloo processes, at tiny shapes."""

from __future__ import annotations

import json

from bench import moe

SMALL = ["--hidden", "64", "--experts", "8", "--top-k", "2", "--inter", "32", "--calls", "2"]


def test_bench_moe_reports_every_ratio_and_equal_outputs(tmp_path):
    out = tmp_path / "moe.json"
    report = moe.main([*SMALL, "--tokens", "1,9", "--eplb-tokens", "8,64", "--eplb-calls", "2",
                       "--spare-per-rank", "2", "--json", str(out)])
    assert set(report["ratios"]) == {"loop_t1", "loop_t9", "transformers_t1", "transformers_t9",
                                     "eplb_step_t8", "eplb_step_t64"}
    assert all(r > 0 for r in report["ratios"].values())
    saved = json.loads(out.read_text())
    for t in (1, 9):
        layer = saved["figures"][f"layer_t{t}"]
        assert layer["transformers_implementation"] in moe.IMPLEMENTATIONS
        assert all(d < 1e-5 for d in layer["max_abs_diff"].values()), layer
    eplb = saved["figures"]["eplb_t64"]
    assert 0.7 < eplb["hot_share_measured"] < 0.9, eplb  # the router was biased to --hot-share 0.8
    assert eplb["imbalance_on"] < eplb["imbalance_off"], eplb


def test_expert_loop_equals_the_block():
    import torch

    args = moe.build_parser().parse_args(SMALL)
    block = moe.make_block(args)
    x = torch.randn(5, args.hidden)
    with torch.no_grad():
        assert torch.allclose(moe.expert_loop(x, block), block(x), atol=1e-6)
