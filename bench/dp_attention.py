"""`pdserve bench dp-attention`: a mixture-of-experts model served by one `pdserve serve` node three ways on
the same cores, one after the other in one run, under the same serving workload:

  tp_ep          --tp-size 2 --ep-size 2: attention tensor-parallel, each rank half the experts (whole)
  dp_attention   --dp-size 2 --enable-dp-attention --ep-size 2: each group's attention over its own
                 requests, the experts as in tp_ep, every sparse block over both groups' tokens
  dp             --dp-size 2: two independent groups, each holding every expert

Model (unless `--model` names a directory): a random-weight Qwen3-MoE over the default model's tokenizer,
hidden 512, 8 layers (8 query and 4 KV heads of 64), 16 experts of 384 features, top 4, built into a
temporary directory. Workload: random prompts of 128-256 tokens, 64 output tokens, at most 16 in flight.

`--json` has each setup's summary (TTFT/TPOT/ITL/E2E, throughput) and the ratios, higher = DP attention did
better:
  dpa_vs_tp_output_throughput   dp_attention's output tokens per second / tp_ep's
  dpa_vs_tp_tpot_p50            tp_ep's median TPOT / dp_attention's
  dpa_vs_dp_output_throughput   dp_attention's / dp's: what the lockstep and the token gathers cost
                                against groups that share nothing (and hold every expert twice)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

from bench.compare import run_colocated_setups
from bench.report import write_report
from bench.serve import add_setup_flags, format_summary, setup_workload

SETUPS = {"tp_ep": "--tp-size 2 --ep-size 2",
          "dp_attention": "--dp-size 2 --enable-dp-attention --ep-size 2",
          "dp": "--dp-size 2"}
MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1024, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
             norm_topk_prob=True, max_position_embeddings=4096)


def build_parser() -> argparse.ArgumentParser:
    from bench.report import HelpFormatter

    p = argparse.ArgumentParser(prog="pdserve bench dp-attention", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_setup_flags(p, "dp-attention", num_prompts=48, input_len=256, output_len=64, concurrency=16)
    p.set_defaults(model=None)
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"which setups, comma-separated: {', '.join(SETUPS)}")
    return p


def build_model(out_dir: str) -> str:
    """The bench's random-weight Qwen3-MoE (`MODEL`) over the default model's tokenizer, in `out_dir`."""
    from common.models.default_model import resolve_model_path
    from common.models.tiny_model import build_tiny_model

    build_tiny_model(out_dir, "qwen3_moe", resolve_model_path("default"), MODEL)
    return out_dir


def compute_ratios(s: dict[str, dict]) -> dict[str, float]:
    dpa, tp, dp = s.get("dp_attention"), s.get("tp_ep"), s.get("dp")
    pairs = {}
    if dpa and tp:
        pairs["dpa_vs_tp_output_throughput"] = (dpa["output_throughput"], tp["output_throughput"])
        pairs["dpa_vs_tp_tpot_p50"] = (tp["tpot_ms"]["p50"], dpa["tpot_ms"]["p50"])
    if dpa and dp:
        pairs["dpa_vs_dp_output_throughput"] = (dpa["output_throughput"], dp["output_throughput"])
    return {k: n / d for k, (n, d) in pairs.items() if n is not None and d and math.isfinite(n / d)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    setups = [x for x in ns.setups.split(",") if x]
    if not setups or set(setups) - set(SETUPS) or ns.num_prompts < 1:
        print(f"--setups must be some of {','.join(SETUPS)} and --num-prompts >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-dpa-") as tmp:
        if ns.model is None:
            print("[dp-attention] building the bench's Qwen3-MoE", file=sys.stderr, flush=True)
            ns.model = build_model(tmp)
        cores, log_dir, requests = setup_workload(ns, "dp-attention")
        for r in requests:  # every request decodes the same number of tokens: the setups' work is equal
            r.output_len = ns.random_output_len
        threads = max(1, len(cores) // 2)  # two ranks in every setup
        runs = run_colocated_setups(ns, [(name, f"{ns.node_args} {SETUPS[name]}", threads, {})
                                         for name in setups], cores, log_dir, requests)
    summaries = {name: run["summary"] for name, run in runs.items()}
    for name, s in summaries.items():
        print(format_summary(name, s))
    ratios = compute_ratios(summaries)
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    figures = {"config": {**vars(ns), "argv": argv, "cores": cores, "model_config": MODEL}, "runs": runs,
               "log_dir": log_dir, "load_average_1m": round(os.getloadavg()[0], 2)}
    write_report(ns.json, "dp-attention", figures, ratios)
    return 0 if all(s["completed"] == ns.num_prompts for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
