"""`pdserve bench dp`: one `pdserve serve` node with --dp-size N against the same node with one scheduler
group, on the same cores, one after the other in one run, under the same serving workload.

Workload: the 16-concurrent shape of issue 19's side-by-side runs (random prompts of 128-256 tokens, 64
output tokens, at most 16 in flight; `--num-prompts` and the length flags change it). The one-group node
runs as `pdserve serve` starts it (every core's torch threads in one scheduler); the DP node splits the
cores between its groups (`common/scheduler/process.py: group_cores`), one group's threads per share.

`--json` has each setup's summary (TTFT/TPOT/ITL/E2E, throughput) and the ratios, DP ÷ one group,
higher = DP did better:
  dp_output_throughput   output tokens per second
  dp_tpot_p50            one group's median TPOT / DP's
  dp_ttft_p99            one group's TTFT p99 / DP's
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from bench.compare import run_colocated_setups
from bench.report import write_report
from bench.serve import format_summary, setup_bench_parser, setup_workload


def build_parser() -> argparse.ArgumentParser:
    return setup_bench_parser("dp", __doc__, "scheduler groups of the DP setup", "dp1,dpN",
                              "which setups to run, comma-separated: dp1 (one group), dpN (--dp-size)",
                              num_prompts=48, input_len=256, output_len=64, concurrency=16)


def compute_ratios(s: dict[str, dict], dp: str) -> dict[str, float]:
    one, many = s.get("dp1"), s.get(dp)
    if not one or not many:
        return {}
    pairs = {"dp_output_throughput": (many["output_throughput"], one["output_throughput"]),
             "dp_tpot_p50": (one["tpot_ms"]["p50"], many["tpot_ms"]["p50"]),
             "dp_ttft_p99": (one["ttft_ms"]["p99"], many["ttft_ms"]["p99"])}
    out = {}
    for key, (num, den) in pairs.items():
        if num is not None and den and math.isfinite(num / den):
            out[key] = num / den
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    setups = [x for x in ns.setups.split(",") if x]
    if ns.dp_size < 2 or ns.num_prompts < 1 or not setups or set(setups) - {"dp1", "dpN"}:
        print("--dp-size must be >= 2, --num-prompts >= 1 and --setups some of dp1,dpN", file=sys.stderr)
        return 2
    cores, log_dir, requests = setup_workload(ns, "dp")
    for r in requests:  # every request decodes the same number of tokens: the setups' work is equal
        r.output_len = ns.random_output_len
    dp = f"dp{ns.dp_size}"
    # threads per rank: every core in the one group; a core share per group with DP
    runs = run_colocated_setups(ns,
                                [(name, f"{ns.node_args} --dp-size {size}", max(1, len(cores) // size), {})
                                 for name, size, key in (("dp1", 1, "dp1"), (dp, ns.dp_size, "dpN"))
                                 if key in setups], cores, log_dir, requests)
    summaries = {name: run["summary"] for name, run in runs.items()}
    for name, s in summaries.items():
        print(format_summary(name, s))
    ratios = compute_ratios(summaries, dp)
    figures = {"config": {**vars(ns), "argv": argv, "cores": cores}, "runs": runs, "log_dir": log_dir,
               "load_average_1m": round(os.getloadavg()[0], 2)}
    write_report(ns.json, "dp", figures, ratios)
    return 0 if all(s["completed"] == ns.num_prompts for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
