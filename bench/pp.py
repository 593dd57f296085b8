"""`pdserve bench pp`: prefill through pipeline stages. One `pdserve serve` node with --pp-size N (a core
share and its threads per stage) against the same node with one stage on every core, and against the
N-stage node with its micro-batches switched off (PDSERVE_PP_MICRO_TOKENS past any batch: each forward
crosses the stages one after the other), one after the other in one run, under the same workload.

Workload: long prompts and one output token, so a request is its prefill (1024-2048 prompt tokens, one
request in flight by default: the time to first token of a prompt alone; `--max-concurrency` for
throughput). Chunked prefill splits a prompt into --chunked-prefill-size chunks (512), and a stage
splits each chunk into micro-batches of PDSERVE_PP_MICRO_TOKENS tokens (64, at most 8).

`--json` has each setup's summary and the ratios, higher = the N-stage node did better:
  pp_ttft_p50             one stage's median TTFT / N stages'
  pp_input_throughput     N stages' prompt tokens per second / one stage's
  pp_microbatch_ttft_p50  N stages without micro-batches, median TTFT / with them
"""

from __future__ import annotations

import argparse
import math
import sys

from bench.compare import run_colocated_setups
from bench.report import write_report
from bench.serve import format_summary, setup_bench_parser, setup_workload

SEQUENTIAL = {"PDSERVE_PP_MICRO_TOKENS": str(1 << 30)}


def build_parser() -> argparse.ArgumentParser:
    return setup_bench_parser("pp", __doc__, "pipeline stages of the PP setups", "pp1,ppN,ppN_sequential",
                              "which setups to run, comma-separated", num_prompts=12,
                              input_len=2000, output_len=1, concurrency=1)


def compute_ratios(s: dict[str, dict], pp: str) -> dict[str, float]:
    one, many, seq = s.get("pp1"), s.get(pp), s.get(f"{pp}_sequential")
    pairs = {}
    if one and many:
        pairs["pp_ttft_p50"] = (one["ttft_ms"]["p50"], many["ttft_ms"]["p50"])
        pairs["pp_input_throughput"] = (many["input_throughput"], one["input_throughput"])
    if many and seq:
        pairs["pp_microbatch_ttft_p50"] = (seq["ttft_ms"]["p50"], many["ttft_ms"]["p50"])
    return {k: num / den for k, (num, den) in pairs.items()
            if num is not None and den and math.isfinite(num / den)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    setups = [x for x in ns.setups.split(",") if x]
    if ns.pp_size < 2 or ns.num_prompts < 1 or not setups or set(setups) - {"pp1", "ppN", "ppN_sequential"}:
        print("--pp-size must be >= 2, --num-prompts >= 1 and --setups some of pp1,ppN,ppN_sequential",
              file=sys.stderr)
        return 2
    cores, log_dir, requests = setup_workload(ns, "pp")
    for r in requests:
        r.output_len = ns.random_output_len
    pp = f"pp{ns.pp_size}"
    stage_threads = max(1, len(cores) // ns.pp_size)
    table = {"pp1": ("pp1", "", len(cores), {}),
             "ppN": (pp, f"--pp-size {ns.pp_size}", stage_threads, {}),
             "ppN_sequential": (f"{pp}_sequential", f"--pp-size {ns.pp_size}", stage_threads, SEQUENTIAL)}
    runs = run_colocated_setups(ns, [(name, f"{ns.node_args} {flags}", threads, env)
                                     for key, (name, flags, threads, env) in table.items() if key in setups],
                                cores, log_dir, requests)
    summaries = {name: run["summary"] for name, run in runs.items()}
    for name, s in summaries.items():
        print(format_summary(name, s))
    ratios = compute_ratios(summaries, pp)
    figures = {"config": {**vars(ns), "argv": argv, "cores": cores}, "runs": runs, "log_dir": log_dir}
    write_report(ns.json, "pp", figures, ratios)
    return 0 if all(s["completed"] == ns.num_prompts for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
