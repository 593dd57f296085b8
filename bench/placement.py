"""`pdserve bench placement`: `pdserve cluster` as it starts by default against one `pdserve serve`
node on the same machine, against the cluster started unpinned (`--cpu-affinity none`, the old
default), against the cluster without conditional disaggregation (`--local-prefill-queue 0`: every
prompt prefilled on the prefill node) and against the cluster whose decode node does not borrow the
prefill node's core while it idles (`--no-core-loan`), one after the other under the same serving
workload.

Workload: the shape of SGLang's `bench_serving` run that first showed the unpinned cluster losing (40
random requests, 128-256 prompt tokens, 16-32 output tokens, at most 8 in flight, all sent at once);
`--num-prompts` and the length flags change it. Every setup uses every core this process may run on
and its own defaults (the colocated node: one scheduler with every core's torch threads). This host's
speed drifts by tens of percent over minutes, so `--rounds N` runs the setups in turn N times: each ratio
is the median of its N per-round ratios (every round's summaries are in the JSON).

`--json` has every setup's summary (TTFT/TPOT/ITL/E2E, throughput) and the ratios, higher = the
default cluster did better:
  cluster_output_throughput   default cluster / colocated output tokens per second
  cluster_itl_p99             colocated / default cluster ITL p99
  placement_output_throughput default cluster / unpinned cluster output tokens per second
  placement_itl_p99           unpinned cluster / default cluster ITL p99
  local_prefill_output_throughput  default cluster / cluster without local prefill, output tokens per second
  local_prefill_ttft_p50      cluster without local prefill / default cluster TTFT p50
  core_loan_output_throughput default cluster / cluster without the core loan, output tokens per second
  core_loan_itl_p99           cluster without the core loan / default cluster ITL p99
Each cluster run also records its nodes' core-loan figures (`core_loan`: the prefill node's idle
seconds, the decode node's forwards and those that ran on the lent core).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import sys
import urllib.request

from bench.compare import colocated_node
from bench.report import HelpFormatter, write_report
from bench.serve import format_summary, measure_setup, setup_workload
from deploy.cluster import DEFAULT_LOCAL_PREFILL_QUEUE, Cluster

SETUPS = ("colocated", "cluster", "cluster_unpinned", "cluster_remote_prefill", "cluster_no_loan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench placement", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--model", default="default", help="model of every setup ('default' or a directory)")
    a("--transfer-backend", default="nixl", choices=("mooncake", "nixl", "ucx", "fake"),
      help="KV transfer engine of the clusters (nixl: `make run`'s)")
    a("--num-prompts", type=int, default=40, help="requests per setup")
    a("--random-input-len", type=int, default=256, help="longest prompt (tokens)")
    a("--random-output-len", type=int, default=32, help="longest output (tokens)")
    a("--random-range-ratio", type=float, default=0.5, help="lengths drawn from [len * ratio, len]")
    a("--max-concurrency", type=int, default=8, help="most requests in flight")
    a("--warmup-requests", type=int, default=2, help="requests sent and discarded before each measured run")
    a("--node-args", default="", help="flags for every node of every setup, one string")
    a("--prefill-args", default="", help="more flags for the clusters' prefill nodes, one string")
    a("--decode-args", default="", help="more flags for the clusters' decode nodes, one string (e.g. "
      "\"--torchao-config int8wo\": int8 weights where steps are bound by memory bandwidth)")
    a("--local-prefill-queue", type=int, default=DEFAULT_LOCAL_PREFILL_QUEUE, metavar="N",
      help="the router's --local-prefill-queue in every cluster setup that prefills on its decode node "
           "(all but cluster_remote_prefill): `pdserve cluster`'s default, or another value to measure")
    a("--setups", default=",".join(SETUPS), help=f"which setups to run, comma-separated, of {SETUPS}")
    a("--rounds", type=int, default=1, help="times every setup runs, in turn; ratios are per-round medians")
    a("--seed", type=int, default=1, help="seed of prompts")
    a("--startup-timeout", type=float, default=900.0, help="seconds for every node to become healthy")
    a("--log-dir", default=None, help="children's logs (default ./logs/placement-<timestamp>)")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--json", default=None, help="write the report here")
    return p


def compute_ratios(s: dict[str, dict]) -> dict[str, float]:
    def r(num, den):
        return num / den if num is not None and den else None

    def tput(name):
        return s[name]["output_throughput"] if name in s else None

    def itl(name):
        return s[name]["itl_ms"]["p99"] if name in s else None

    def ttft(name):
        return s[name]["ttft_ms"]["p50"] if name in s else None

    pairs = {"cluster_output_throughput": r(tput("cluster"), tput("colocated")),
             "cluster_itl_p99": r(itl("colocated"), itl("cluster")),
             "placement_output_throughput": r(tput("cluster"), tput("cluster_unpinned")),
             "placement_itl_p99": r(itl("cluster_unpinned"), itl("cluster")),
             "local_prefill_output_throughput": r(tput("cluster"), tput("cluster_remote_prefill")),
             "local_prefill_ttft_p50": r(ttft("cluster_remote_prefill"), ttft("cluster")),
             "core_loan_output_throughput": r(tput("cluster"), tput("cluster_no_loan")),
             "core_loan_itl_p99": r(itl("cluster_no_loan"), itl("cluster"))}
    return {k: v for k, v in pairs.items() if v is not None and math.isfinite(v)}


def median_ratios(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each ratio's median over the rounds that have it."""
    names = {k for r in rounds for k in r}
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in sorted(names)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    setups = [x for x in ns.setups.split(",") if x]
    if not setups or set(setups) - set(SETUPS) or ns.num_prompts < 1 or ns.rounds < 1 \
            or ns.local_prefill_queue < 1:
        print(f"--setups must name some of {SETUPS}; --num-prompts, --rounds and --local-prefill-queue must "
              "be >= 1 (the cluster_remote_prefill setup is the one without local prefill)", file=sys.stderr)
        return 2
    cores, log_dir, requests = setup_workload(ns, "placement")
    node_args = shlex.split(ns.node_args)
    # colocated_node reads these: the colocated node as `pdserve serve` starts it (every core's threads)
    ns.colocated_threads, ns.omp_wait_policy = None, ""
    old_handler = signal.signal(signal.SIGTERM, _terminate)  # the children are stopped on SIGTERM too
    rounds = []
    try:
        for i in range(ns.rounds):
            print(f"\nround {i + 1}/{ns.rounds}", file=sys.stderr, flush=True)
            round_dir = os.path.join(log_dir, f"round{i + 1}")
            os.makedirs(round_dir, exist_ok=True)
            load, runs = _run_setups(setups, ns, cores, round_dir, requests, node_args)
            summaries = {name: run["summary"] for name, run in runs.items()}
            for name, s in summaries.items():
                print(format_summary(name, s))
            rounds.append({"runs": runs, "load_average_1m": load, "ratios": compute_ratios(summaries)})
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    figures = {"config": {**vars(ns), "argv": argv, "cores": cores}, "rounds": rounds, "log_dir": log_dir}
    write_report(ns.json, "placement", figures, median_ratios([r["ratios"] for r in rounds]))
    return 0 if all(run["summary"]["completed"] == ns.num_prompts
                    for r in rounds for run in r["runs"].values()) else 1


def _run_setups(setups, ns, cores, log_dir, requests, node_args) -> tuple[dict, dict]:
    load = {"start": round(os.getloadavg()[0], 2)}
    runs = {}
    for name in setups:
        print(f"\n[{name}] on cores {cores}", file=sys.stderr, flush=True)
        if name == "colocated":
            with colocated_node(ns, cores, log_dir) as node:
                runs[name] = measure_setup(name, node.url, requests, ns)
            continue
        cluster = Cluster(num_prefill=1, num_decode=1, model=ns.model, transfer_backend=ns.transfer_backend,
                          log_dir=os.path.join(log_dir, name), auto_placement=name != "cluster_unpinned",
                          local_prefill_queue=0 if name == "cluster_remote_prefill"
                          else ns.local_prefill_queue,
                          node_args=node_args, prefill_args=shlex.split(ns.prefill_args),
                          decode_args=shlex.split(ns.decode_args), startup_timeout=ns.startup_timeout,
                          core_loan=name != "cluster_no_loan")
        with cluster:
            runs[name] = measure_setup(name, cluster.url, requests, ns)
            runs[name]["placement"] = {c.name: c.cores for c in cluster.children}
            runs[name]["core_loan"] = {c.name: _loan_stats(c.url)
                                       for c in cluster.children if c.role != "router"}
    load["end"] = round(os.getloadavg()[0], 2)
    return load, runs


def _loan_stats(url: str) -> dict:
    """A node's core-loan figures from its /server_info (empty when it has no loan)."""
    with urllib.request.urlopen(url + "/server_info", timeout=30) as resp:
        stats = json.load(resp).get("stats", {})
    return {k: v for k, v in stats.items() if k.startswith("core_loan")}


def _terminate(signum, _frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
