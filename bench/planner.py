"""`pdserve bench planner`: the SLO planner against fixed prefill/decode splits of the same four nodes, one
after the other in one run, under a load whose shape shifts.

Setups (each a local cluster of four nodes and a router, `deploy.cluster.Cluster`, cores placed as
`pdserve cluster` places them):

  planner   2 prefill + 2 decode nodes, the router with `--planner slo` (router/planner.py): it moves nodes
            between the pools with role switches as the load shifts
  fixed_3p1d, fixed_2p2d, fixed_1p3d   the same nodes, split once at launch and never changed

Every setup starts its nodes with flags both roles take, so the fixed splits run exactly the nodes the
planner does. Each node is a machine of `--node-cpu` cores (a CPU quota of its own, `CpuQuota`: a cgroup
per node holding its front end and its scheduler processes): four nodes sharing this machine's cores
unbounded would pool them, and on two cores every split then has the same compute, so none could do
better than another; with a quota a pool's capacity is its node count, as on separate machines.
Workload (the same requests, same arrival times, for every setup): phases of Poisson
arrivals, prompt-heavy (long prompts, a few output tokens) → output-heavy (short prompts, many tokens) →
prompt-heavy again. Each decode node runs at most `--max-running` requests, so the output-heavy phase
needs decode nodes; the long prompts need prefill nodes. Model (unless `--model` names one): a random-
weight llama over the default model's tokenizer, built into a temporary directory.

A request attains the SLOs when it succeeded, its TTFT is within `--ttft-slo` and its time per output
token within `--itl-slo`. Figures per setup: attainment overall and per phase, the summary, `lost` (a
request without a complete answer: an HTTP error, a broken stream), `refused` (a 429: the cluster was
full and said so; it misses the SLOs but is an answer), `duplicated` (an answer with more
tokens than asked, or more successful answers on the router's books than the client received), and the
planner's moves. `--json` ratios, higher = the planner did better:
  planner_vs_best_fixed    the planner's attainment / the best fixed split's (the split an operator who
                           knew the load in advance would have chosen)
  planner_vs_worst_fixed   the planner's attainment / the worst fixed split's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

from bench.compare import child_env
from bench.report import HelpFormatter, write_report
from bench.serve import BenchRequest, PromptMaker, fetch_model_info, percentiles, run_benchmark, summarize
from bench.slo import attainment

SETUPS = {"planner": (2, 2), "fixed_3p1d": (3, 1), "fixed_2p2d": (2, 2), "fixed_1p3d": (1, 3)}
MODEL = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             intermediate_size=1536, max_position_embeddings=4096)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench planner", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--model", default=None, help="model directory (default: the bench's random llama, built here)")
    a("--setups", default=",".join(SETUPS), help=f"which setups, comma-separated: {', '.join(SETUPS)}")
    a("--transfer-backend", default="mooncake", choices=("mooncake", "nixl", "ucx", "fake"))
    a("--phases", default="prompt:45:1.6:1024:4,output:45:4.8:32:96,prompt:45:1.6:1024:4",
      help="the load, phase after phase: name:seconds:requests per second:prompt tokens:output tokens")
    a("--ttft-slo", type=float, default=3.0, help="seconds to the first token")
    a("--itl-slo", type=float, default=0.1, help="seconds per output token after the first")
    a("--max-running", type=int, default=5, help="requests a node runs at once (--max-running-requests)")
    a("--node-cpu", type=float, default=0.4,
      help="cores each node may use (a cgroup CPU quota per node; 0: no quota, the nodes share the cores)")
    a("--planner-args", default="--planner-interval-secs 2 --planner-window-secs 6 --planner-patience 2 "
                                "--planner-cooldown-secs 5",
      help="the planner's router flags besides --planner and the SLOs")
    a("--node-args", default="--max-total-tokens 65536 --chunked-prefill-size 512 "
                             "--disaggregation-prealloc-size 64 --page-size 16 --max-queued-requests 512",
      help="flags of every node, both roles")
    a("--seed", type=int, default=0)
    a("--startup-timeout", type=float, default=600.0)
    a("--log-dir", default=None, help="where the clusters' logs go (default: a folder under /tmp)")
    a("--json", default=None, help="write the report here")
    return p


def parse_phases(spec: str) -> list[dict]:
    phases = []
    for part in spec.split(","):
        name, seconds, rate, prompt, output = part.split(":")
        phases.append({"name": name, "seconds": float(seconds), "rate": float(rate), "prompt": int(prompt),
                       "output": int(output)})
    if not phases or any(ph["seconds"] <= 0 or ph["rate"] <= 0 or ph["output"] < 2 for ph in phases):
        raise ValueError(f"--phases: {spec!r}")
    return phases


def build_requests(phases: list[dict], maker: PromptMaker, seed: int) -> list[BenchRequest]:
    """Poisson arrivals phase after phase, each request tagged `<index>-<phase>`; the same for every setup."""
    rng, out, start = random.Random(seed), [], 0.0
    for i, ph in enumerate(phases):
        t = start + rng.expovariate(ph["rate"])
        while t < start + ph["seconds"]:
            out.append(BenchRequest(maker.text(ph["prompt"]), ph["prompt"], ph["output"],
                                    tag=f"{i}-{ph['name']}", send_at=t))
            t += rng.expovariate(ph["rate"])
        start += ph["seconds"]
    return out


def compute_ratios(att: dict[str, float]) -> dict[str, float]:
    fixed = [v for k, v in att.items() if k.startswith("fixed_")]
    if "planner" not in att or not fixed:
        return {}
    best, worst = max(fixed), min(fixed)
    out = {}
    if best > 0:
        out["planner_vs_best_fixed"] = att["planner"] / best
    if worst > 0:
        out["planner_vs_worst_fixed"] = att["planner"] / worst
    return out


def router_ok_answers(url: str) -> int:
    """Generation answers the router gave with status 200 (its /metrics)."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("smg_http_responses_total{") and 'status_code="200"' in line)


def planner_state(url: str) -> dict:
    import urllib.request

    data = json.loads(urllib.request.urlopen(url + "/dashboard/data", timeout=10).read())
    return data.get("planner") or {}


class CpuQuota:
    """A CPU quota per node: a cgroup (v2 `cpu.max`, else v1 `cpu.cfs_quota_us`) holding the node's processes
    (its front end and every process under it), `cores` of CPU time per 20 ms period. 0 cores: none."""

    PERIOD_US = 20000
    V2, V1 = "/sys/fs/cgroup", "/sys/fs/cgroup/cpu"

    def __init__(self, cores: float, setup: str) -> None:
        self.cores, self.setup, self.dirs = cores, setup, []
        self.v2 = os.path.exists(os.path.join(self.V2, "cgroup.subtree_control"))

    def confine(self, name: str, pid: int) -> None:
        if self.cores <= 0:
            return
        import psutil

        path = os.path.join(self.V2 if self.v2 else self.V1, f"pdserve-bench-{self.setup}-{name}")
        os.makedirs(path, exist_ok=True)
        self.dirs.append(path)
        quota = max(1000, int(self.cores * self.PERIOD_US))
        if self.v2:
            _write(os.path.join(path, "cpu.max"), f"{quota} {self.PERIOD_US}")
        else:
            _write(os.path.join(path, "cpu.cfs_period_us"), str(self.PERIOD_US))
            _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            _write(os.path.join(path, "cgroup.procs"), str(p.pid))

    def remove(self) -> None:
        """The cluster stopped: the cgroups go (a process still exiting is waited for a few seconds)."""
        for path in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except OSError as e:
                    last = e
                    time.sleep(0.1)
            else:
                print(f"[planner] could not remove {path}: {last}", file=sys.stderr)
        self.dirs = []


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def run_setup(name: str, ns: argparse.Namespace, requests: list[BenchRequest], log_dir: str) -> dict:
    from deploy.cluster import Cluster

    prefill, decode = SETUPS[name]
    router_args = ["--policy", "round_robin", "--health-check-interval-secs", "2"]
    if name == "planner":
        router_args += ["--planner", "slo", "--ttft-slo", str(ns.ttft_slo), "--itl-slo", str(ns.itl_slo),
                        *ns.planner_args.split()]
    node_args = ["--max-running-requests", str(ns.max_running), *ns.node_args.split()]
    cluster = Cluster(num_prefill=prefill, num_decode=decode, model=ns.model,
                      transfer_backend=ns.transfer_backend, log_dir=os.path.join(log_dir, name),
                      auto_placement=True, core_loan=False, switchable=True, node_args=node_args,
                      router_args=router_args, env=child_env(argparse.Namespace(
                          omp_wait_policy="PASSIVE", transfer_backend=ns.transfer_backend)),
                      startup_timeout=ns.startup_timeout, quiet=True)
    print(f"\n[{name}] {prefill} prefill + {decode} decode nodes, {len(requests)} requests",
          file=sys.stderr, flush=True)
    cluster.start()
    quota = CpuQuota(ns.node_cpu, name)
    try:
        for node in cluster.nodes:
            quota.confine(node.name, node.proc.pid)
        model, _ = asyncio.run(fetch_model_info(cluster.url))
        results, duration = asyncio.run(run_benchmark(cluster.url, requests, model=model, warmup=2,
                                                      seed=ns.seed, progress=False, timeout=600))
        answered = router_ok_answers(cluster.url) - 2  # the warmup requests
        state = planner_state(cluster.url) if name == "planner" else {}
    finally:
        cluster.stop()
        quota.remove()
    ok = [r for r in results if r.ok]
    refused = [r for r in results if not r.ok and r.error.startswith("HTTP 429")]
    over = [res for req, res in zip(requests, results, strict=True)
            if res.ok and res.output_len > req.output_len]
    ttft_ms, itl_ms = ns.ttft_slo * 1000, ns.itl_slo * 1000
    phases = {}
    for tag in sorted({r.tag for r in results}):
        rs = [r for r in results if r.tag == tag]
        phases[tag] = {"requests": len(rs), "attainment": round(attainment(rs, ttft_ms, itl_ms), 4),
                       "ttft_p90_s": percentiles([r.ttft for r in rs if r.ok], scale=1)["p90"],
                       "tpot_p90_s": percentiles([r.tpot for r in rs if r.ok and r.tpot is not None],
                                                 scale=1)["p90"]}
    return {"prefill": prefill, "decode": decode,
            "attainment": round(attainment(results, ttft_ms, itl_ms), 4), "phases": phases,
            "lost": len(results) - len(ok) - len(refused), "refused": len(refused),
            "duplicated": len(over) + max(0, answered - len(ok)),
            "errors": sorted({r.error[:160] for r in results if not r.ok})[:10],
            "moves": state.get("moves", 0), "move_failures": state.get("failures", 0),
            "planner_decisions": [d for d in state.get("decisions", []) if d.get("action") != "hold"],
            "summary": summarize(results, duration, ttft_ms, itl_ms)}


def build_model(out_dir: str) -> str:
    from common.models.default_model import resolve_model_path
    from common.models.tiny_model import build_tiny_model

    build_tiny_model(out_dir, "llama", resolve_model_path("default"), MODEL)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    setups = [x for x in ns.setups.split(",") if x]
    try:
        phases = parse_phases(ns.phases)
    except ValueError as e:
        print(f"pdserve bench planner: {e}", file=sys.stderr)
        return 2
    if not setups or set(setups) - set(SETUPS):
        print(f"--setups must be some of {','.join(SETUPS)}", file=sys.stderr)
        return 2
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-planner-")
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-planner-model-") as tmp:
        if ns.model is None:
            print("[planner] building the bench's llama", file=sys.stderr, flush=True)
            ns.model = build_model(tmp)
        from common.models.default_model import resolve_model_path

        requests = build_requests(phases, PromptMaker(resolve_model_path("default"), ns.seed), ns.seed)
        runs = {}
        for name in setups:
            start = time.monotonic()
            runs[name] = run_setup(name, ns, requests, log_dir)
            runs[name]["seconds"] = round(time.monotonic() - start, 1)
            r = runs[name]
            print(f"[{name}] attainment {r['attainment']:.3f} "
                  + " ".join(f"{t} {p['attainment']:.2f}" for t, p in r["phases"].items())
                  + f"; lost {r['lost']}, refused {r['refused']}, duplicated {r['duplicated']}, "
                  f"moves {r['moves']}",
                  file=sys.stderr, flush=True)
    att = {name: run["attainment"] for name, run in runs.items()}
    ratios = compute_ratios(att)
    figures = {"config": {**vars(ns), "argv": argv, "phases": phases, "model_config": MODEL},
               "attainment": att, "runs": runs, "lost": sum(r["lost"] for r in runs.values()),
               "refused": sum(r["refused"] for r in runs.values()),
               "duplicated": sum(r["duplicated"] for r in runs.values()),
               "switches": runs.get("planner", {}).get("moves", 0), "log_dir": log_dir,
               "load_average_1m": round(os.getloadavg()[0], 2)}
    write_report(ns.json, "planner", figures, ratios)
    return 0 if figures["lost"] == 0 and figures["duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
