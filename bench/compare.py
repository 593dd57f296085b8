"""`pdserve bench compare`: the same workload on (a) a disaggregated cluster — one prefill node pinned to
one set of cores, one decode node pinned to another, the router (`--cluster default`: the cluster as
`pdserve cluster` starts it on those cores, its core loan and local prefills included) — and (b) one
colocated `pdserve serve` node on all of those cores, one after the other in one run.

Workload (the case disaggregation is for): a steady stream of ordinary requests (short prompt, long
answer: "decodes") that keep the decode batch busy, and long prompts arriving among them every
`--long-interval` seconds. In a colocated engine each long prefill stalls every running decode (TPOT
spikes); with PD the prefill runs on its own cores and the decodes keep their pace.

Then, on the same running setups, SLO attainment over a sweep of Poisson request rates (`--rates`,
bench/slo.py): `--sweep-requests` requests of `--sweep-input-len` / `--sweep-output-len` tokens
(lengths drawn from [len * 0.5, len]; other prompts at each rate, the same for both setups, which
the workload above has warmed) per rate, and the highest rate at which 90 % of them meet both
`--slo-rate-ttft-ms` and `--slo-rate-tpot-ms` (a setup that misses them at the lowest rate is swept
further down, halving the rate to `--min-rate`). Those SLOs were fixed before any run: first token
within 2 s, then 10 tokens per second (interactive chat on a CPU, about twice reading speed).

`--rounds N` measures both setups N times, each round on restarted nodes, in alternating order, with
other sweep prompts: one run's crossing moves by up to 2x on a shared 2-core host. The report pools
every round's requests (the sweep per rate, weighting each rate by the requests sent there), and gives
each round's own highest rates and `slo_rate` beside the pooled ones.

Both setups start through deploy's launcher: (a) is a `Cluster` (deploy/cluster.py), (b) a
`ColocatedNode`, a `ServerProcess` (deploy/process.py) running `pdserve serve` with the bench's node
flags on the given cores; the other benches with a colocated node (dp, pp, placement, gpu-pd, netfaults,
startup) start theirs with it too.

Reports, for each setup and for each class of request, TTFT/TPOT/ITL/E2E (mean, p50, p90, p99),
throughput and goodput (requests meeting `--slo-ttft-ms` and `--slo-tpot-ms`), a markdown table of the
ratios (`--markdown`), latency CDFs (`--plot`), and `--json` with `"ratios"`:
  tpot_p99  colocated / disaggregated TPOT p99 of the decode requests (higher = PD better)
  ttft_p99  colocated / disaggregated TTFT p99 over all requests
  goodput   disaggregated / colocated goodput over all requests
  slo_rate  disaggregated / colocated highest rate with 90 % SLO attainment (when both are > 0)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import shlex
import signal
import sys
import time

from bench.report import HelpFormatter, write_report
from bench.serve import (
    BenchRequest,
    PromptMaker,
    RequestResult,
    format_summary,
    plot_cdfs,
    random_dataset,
    result_rows,
    run_benchmark,
    summarize,
)
from bench.slo import max_rate, points_of, pooled, sweep
from common.cores import parse_cores
from deploy.cluster import DEFAULT_LOCAL_PREFILL_QUEUE, Cluster
from deploy.process import ServerProcess


def child_env(ns: argparse.Namespace) -> dict[str, str]:
    """Environment of every node of both setups. OpenMP threads that spin while waiting (the default)
    collapse when the machine is shared (a 2-thread node measured 8x slower per token at load 10 than
    with OMP_WAIT_POLICY=PASSIVE); both setups get the same policy."""
    env = {"OMP_WAIT_POLICY": ns.omp_wait_policy} if ns.omp_wait_policy else {}
    # mooncake listens on every interface whatever --host says (transfer/mooncake.py); a node refuses that
    # unless acknowledged, and a measurement on this machine acknowledges it
    mooncake = getattr(ns, "transfer_backend", None) == "mooncake"  # (a colocated-only bench has none)
    ack = {"PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN": "1"} if mooncake else {}
    return {**env, **ack, **getattr(ns, "node_env", {})}


def build_workload(maker: PromptMaker, ns: argparse.Namespace) -> list[BenchRequest]:
    """Decodes at a fixed rate over the whole window, long prompts every long_interval seconds from
    `long_start` on; sorted by send time."""
    reqs: list[BenchRequest] = []
    for i in range(ns.num_decodes):
        r = BenchRequest(maker.text(ns.decode_input_len), ns.decode_input_len, ns.decode_output_len,
                         "completions", "decode", send_at=i / ns.decode_rate)
        reqs.append(r)
    for j in range(ns.num_long):
        r = BenchRequest(maker.text(ns.long_input_len), ns.long_input_len, ns.long_output_len,
                         "completions", "long", send_at=ns.long_start + j * ns.long_interval)
        reqs.append(r)
    reqs.sort(key=lambda r: r.send_at)
    return reqs


def disaggregated_setup(ns: argparse.Namespace, node_args: list[str], cores: list[int],
                        log_dir: str) -> Cluster:
    """Setup (a), not started: with `--cluster default` the decode node keeps the cluster's own local
    chunk size (the node flags' --chunked-prefill-size is for prefill nodes and the colocated node)."""
    common = dict(num_prefill=1, num_decode=1, model=ns.model,
                  transfer_backend=ns.transfer_backend, log_dir=log_dir,
                  env=child_env(ns), startup_timeout=ns.startup_timeout,
                  router_args=["--policy", "round_robin"])
    if ns.cluster == "default":
        return Cluster(**common, auto_placement=True, cores=cores, local_prefill_queue=ns.local_prefill_queue,
                       prefill_args=node_args,
                       decode_args=_without_flag(node_args, "--chunked-prefill-size")
                       + shlex.split(ns.decode_args))
    return Cluster(**common, cpu_affinity={"prefill": ns.prefill_cores_list, "decode": ns.decode_cores_list},
                   node_args=node_args, decode_args=shlex.split(ns.decode_args))


def _without_flag(args: list[str], flag: str) -> list[str]:
    """`args` without `flag` and its value (given as `flag value` or `flag=value`)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


class ColocatedNode(ServerProcess):
    """One colocated node as `pdserve serve` starts it: the bench's node flags as given, on 127.0.0.1."""

    def __init__(self, model: str, flags: list[str], **kw):
        super().__init__("colocated", **kw)
        self.model, self.flags = model, list(flags)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "deploy.cli", "serve", "--model", self.model, "--host", self.host,
                "--port", str(self.port), *self.flags]


def colocated_node(ns: argparse.Namespace, cores: list[int], log_dir: str) -> ColocatedNode:
    """Setup (b), not started (`with colocated_node(...) as node`): `ns.node_args` on `cores`, with
    `ns.colocated_threads` torch threads (default: one per core), its log `<log_dir>/colocated.log`."""
    threads = ns.colocated_threads or len(cores)
    return ColocatedNode(ns.model, ["--num-threads", str(threads), *shlex.split(ns.node_args)], cores=cores,
                         env=child_env(ns), log_path=os.path.join(log_dir, "colocated.log"),
                         startup_timeout=ns.startup_timeout, echo_command=True)


def run_colocated_setups(ns: argparse.Namespace, setups: list[tuple[str, str, int, dict]], cores: list[int],
                         log_dir: str, requests: list[BenchRequest]) -> dict[str, dict]:
    """Each setup (name, node flags, torch threads per rank, environment) as one `pdserve serve` node on
    `cores`, started, measured with `requests` (`bench.serve.measure_setup`) and stopped, one after the
    other."""
    from bench.serve import measure_setup

    runs = {}
    for name, node_args, threads, env in setups:
        setup = argparse.Namespace(**vars(ns))
        setup.node_args, setup.colocated_threads, setup.node_env = node_args, threads, env
        setup.omp_wait_policy = getattr(ns, "omp_wait_policy", "")
        print(f"\n[{name}] on cores {cores}: {node_args.strip() or 'defaults'}, {threads} torch threads "
              "per rank"
              + (f", {env}" if env else ""), file=sys.stderr, flush=True)
        os.makedirs(os.path.join(log_dir, name), exist_ok=True)
        with colocated_node(setup, cores, os.path.join(log_dir, name)) as node:
            runs[name] = measure_setup(name, node.url, requests, ns)
    return runs


def run_setup(name: str, url: str, requests: list[BenchRequest], ns: argparse.Namespace,
              model: str) -> tuple[list[RequestResult], float]:
    print(f"\n[{name}] {len(requests)} requests against {url}", file=sys.stderr, flush=True)
    return asyncio.run(run_benchmark(url, requests, model=model, warmup=ns.warmup_requests, seed=ns.seed,
                                     progress=not ns.disable_tqdm))


def by_tag(results: list[RequestResult], duration: float, ns: argparse.Namespace) -> dict:
    out = {"all": summarize(results, duration, ns.slo_ttft_ms, ns.slo_tpot_ms)}
    for tag in sorted({r.tag for r in results}):
        out[tag] = summarize([r for r in results if r.tag == tag], duration, ns.slo_ttft_ms, ns.slo_tpot_ms)
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def compute_ratios(dis: dict, col: dict) -> dict[str, float]:
    """The headline ratios, oriented so that higher means the disaggregated setup did better; a ratio
    whose denominator is zero or missing is left out."""
    pairs = {"tpot_p99": ratio(col["decode"]["tpot_ms"]["p99"], dis["decode"]["tpot_ms"]["p99"]),
             "ttft_p99": ratio(col["all"]["ttft_ms"]["p99"], dis["all"]["ttft_ms"]["p99"]),
             "goodput": ratio(dis["all"]["goodput"], col["all"]["goodput"])}
    return {k: v for k, v in pairs.items() if v is not None and math.isfinite(v)}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _setup_a(ns: argparse.Namespace) -> str:
    flags = f", decode node flags `{ns.decode_args}`" if ns.decode_args else ""
    if ns.cluster == "default":
        return ("- (a) the cluster as `pdserve cluster` starts it on cores "
                f"{ns.prefill_cores_list + ns.decode_cores_list}: {getattr(ns, 'placement_note', '')}; "
                f"--local-prefill-queue {ns.local_prefill_queue} ({ns.transfer_backend} backend{flags}) "
                "+ router")
    return (f"- (a) 1 prefill node on cores {ns.prefill_cores_list} + 1 decode node on cores "
            f"{ns.decode_cores_list} ({ns.transfer_backend} backend{flags}) + router")


def slo_rate_by_round(round_sweeps: dict[str, list[list[dict]]]) -> list[float | None]:
    """Each round's own `slo_rate` (None where a setup kept no rate), to show the spread of the pooled one."""
    if len(round_sweeps) != 2:
        return []
    pairs = zip(round_sweeps["disaggregated"], round_sweeps["colocated"], strict=True)
    return [None if r is None else round(r, 4)
            for r in (ratio(max_rate(points_of(d)), max_rate(points_of(c))) for d, c in pairs)]


def markdown_table(dis: dict, col: dict, ns: argparse.Namespace, commands: list[str],
                   sweeps: dict[str, list[dict]] | None = None,
                   round_sweeps: dict[str, list[list[dict]]] | None = None) -> str:
    rows = [
        ("TPOT p99, decode requests (ms)", ("decode", "tpot_ms", "p99"), "col/dis"),
        ("TPOT p50, decode requests (ms)", ("decode", "tpot_ms", "p50"), "col/dis"),
        ("ITL p99, decode requests (ms)", ("decode", "itl_ms", "p99"), "col/dis"),
        ("TTFT p99, all (ms)", ("all", "ttft_ms", "p99"), "col/dis"),
        ("TTFT p50, all (ms)", ("all", "ttft_ms", "p50"), "col/dis"),
        ("TTFT p99, long prompts (ms)", ("long", "ttft_ms", "p99"), "col/dis"),
        ("E2E p99, all (ms)", ("all", "e2e_ms", "p99"), "col/dis"),
        ("goodput (req/s)", ("all", "goodput", None), "dis/col"),
        ("output throughput (tok/s)", ("all", "output_throughput", None), "dis/col"),
        ("completed / failed", None, None),
    ]

    def get(s: dict, path):
        tag, key, sub = path
        v = s.get(tag, {}).get(key)
        return v.get(sub) if sub and isinstance(v, dict) else v

    lines = ["| metric | disaggregated (a) | colocated (b) | ratio (higher = PD better) |",
             "|---|---|---|---|"]
    for label, path, kind in rows:
        if path is None:
            lines.append(f"| {label} | {dis['all']['completed']} / {dis['all']['failed']} | "
                         f"{col['all']['completed']} / {col['all']['failed']} | |")
            continue
        a, b = get(dis, path), get(col, path)
        r = ratio(b, a) if kind == "col/dis" else ratio(a, b)
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | {_fmt(r) + 'x' if r is not None else 'n/a'} |")
    if sweeps and len(sweeps) == 2:
        best = {name: max_rate(points_of(pts)) for name, pts in sweeps.items()}
        r = ratio(best["disaggregated"], best["colocated"])
        lines.append(f"| highest rate with 90 % within TTFT {ns.slo_rate_ttft_ms:.0f} ms and TPOT "
                     f"{ns.slo_rate_tpot_ms:.0f} ms (req/s) | {_fmt(best['disaggregated'])} | "
                     f"{_fmt(best['colocated'])} | {_fmt(r) + 'x' if r is not None else 'n/a'} |")
        for name in ("disaggregated", "colocated"):
            pts = ", ".join(f"{p['rate']:g}: {p['attainment']:.0%}"
                            + (f" of {p['requests']}" if "requests" in p else "")
                            for p in sweeps[name])
            lines.append(f"| SLO attainment by rate, {name} | {pts} | | |")
        if round_sweeps and len(round_sweeps["disaggregated"]) > 1:
            each = {name: [max_rate(points_of(r)) for r in rr] for name, rr in round_sweeps.items()}
            by_round = slo_rate_by_round(round_sweeps)
            lines.append("| the same, each round on its own (req/s) | "
                         + " | ".join(", ".join(_fmt(v) for v in each[name])
                                      for name in ("disaggregated", "colocated"))
                         + " | "
                         + ", ".join(_fmt(r) + "x" if r is not None else "n/a" for r in by_round) + " |")
    slo = f"SLO: TTFT <= {ns.slo_ttft_ms:.0f} ms, TPOT <= {ns.slo_tpot_ms:.0f} ms"
    work = (f"{ns.num_decodes} decode requests ({ns.decode_input_len} prompt / {ns.decode_output_len} output "
            f"tokens, {ns.decode_rate}/s) + {ns.num_long} long prompts ({ns.long_input_len} tokens, "
            f"{ns.long_output_len} output) every {ns.long_interval}s")
    head = [f"# pdserve bench compare: disaggregated vs colocated ({ns.model_label})", "",
            f"- workload: {work}", f"- {slo}",
            _setup_a(ns),
            f"- (b) one `pdserve serve` on cores {ns.prefill_cores_list + ns.decode_cores_list} with "
            f"{ns.colocated_threads or len(ns.prefill_cores_list + ns.decode_cores_list)} torch threads",
            f"- every node: OMP_WAIT_POLICY={ns.omp_wait_policy or '(default)'}; node flags `{ns.node_args}`",
            f"- machine load average (1 min) at start / end: {ns.load_note}", "",
            "Ratios: latency = colocated / disaggregated, throughput = disaggregated / colocated.", ""]
    tail = ["", "Commands:", "", "```", *commands, "```", ""]
    return "\n".join(head + lines + tail)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--model", default="default", help="model of both setups ('default' or a directory)")
    a("--transfer-backend", default="mooncake", choices=("mooncake", "nixl", "ucx", "fake"),
      help="KV transfer engine of the disaggregated setup")
    a("--cluster", choices=("pinned", "default"), default="pinned",
      help="(a): 'pinned', one prefill and one decode node on the given cores and nothing more; 'default', "
           "the cluster as `pdserve cluster` starts it on those cores (its own placement, the decode node "
           "borrowing the prefill node's cores while it idles, and prefilling itself while the prefill "
           "node's queue is long)")
    a("--local-prefill-queue", type=int, default=None, metavar="N",
      help="with --cluster default: the router's --local-prefill-queue (default "
           f"{DEFAULT_LOCAL_PREFILL_QUEUE}, `pdserve cluster`'s; 0: off)")
    a("--prefill-cores", default="0", help="cores of the prefill node in (a)")
    a("--decode-cores", default="1", help="cores of the decode node in (a); (b) gets both sets")
    a("--node-args", default="--chunked-prefill-size 256 --max-total-tokens 32768",
      help="flags for every node of both setups, one string")
    a("--colocated-threads", type=int, default=None, help="torch threads of (b) (default: its core count)")
    a("--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY of every node ('' keeps the default)")
    a("--num-decodes", type=int, default=16, help="short decode-heavy requests")
    a("--decode-rate", type=float, default=0.5, help="decode requests per second")
    a("--decode-input-len", type=int, default=32, help="prompt tokens of each decode-heavy request")
    a("--decode-output-len", type=int, default=64, help="output tokens of each decode-heavy request")
    a("--num-long", type=int, default=4, help="long prefill-heavy prompts interleaved with them")
    a("--long-input-len", type=int, default=768, help="prompt tokens of each long prompt")
    a("--long-output-len", type=int, default=4, help="output tokens of each long prompt")
    a("--long-start", type=float, default=4.0, help="seconds before the first long prompt")
    a("--long-interval", type=float, default=8.0, help="seconds between long prompts")
    a("--slo-ttft-ms", type=float, default=30000.0, help="goodput: TTFT limit")
    a("--slo-tpot-ms", type=float, default=1500.0, help="goodput: TPOT limit")
    a("--rates", default="0.5,0.75,1,1.25,1.5,2,2.5,3,4", help="request rates (req/s) of the SLO sweep, "
      "comma-separated ('' skips it)")
    a("--min-rate", type=float, default=0.1, help="when a setup misses the SLOs at the lowest rate, the "
      "sweep halves the rate until it keeps them, down to this (req/s)")
    a("--sweep-requests", type=int, default=32, help="requests per rate of the sweep")
    a("--rounds", type=int, default=1, help="measure both setups this many times, restarted each round and "
      "in alternating order, other sweep requests each round; the report pools every round's requests (per "
      "rate for the SLO sweep) and gives each round's own highest rates and slo_rate beside")
    a("--sweep-input-len", type=int, default=256, help="longest prompt of the sweep's requests (tokens)")
    a("--sweep-output-len", type=int, default=64, help="longest output of the sweep's requests (tokens)")
    a("--slo-rate-ttft-ms", type=float, default=2000.0, help="the sweep's TTFT SLO (fixed before any run)")
    a("--slo-rate-tpot-ms", type=float, default=100.0, help="the sweep's TPOT SLO (fixed before any run)")
    a("--decode-args", default="", help="more flags for the disaggregated setup's decode node, one string "
      "(e.g. \"--torchao-config int8wo\")")
    a("--warmup-requests", type=int, default=2, help="requests sent and discarded before each measured run")
    a("--seed", type=int, default=1, help="seed of prompts")
    a("--startup-timeout", type=float, default=900.0, help="seconds for every node to become healthy")
    a("--log-dir", default=None, help="children's logs (default ./logs/compare-<timestamp>)")
    a("--only", choices=("both", "disaggregated", "colocated"), default="both", help=argparse.SUPPRESS)
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--json", default=None, help="write the report here")
    a("--markdown", default=None, help="write the markdown table here")
    a("--plot", default=None, help="latency CDF PNG (default: the --json path with .png)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    ns.prefill_cores_list, ns.decode_cores_list = parse_cores(ns.prefill_cores), parse_cores(ns.decode_cores)
    if set(ns.prefill_cores_list) & set(ns.decode_cores_list):
        print("--prefill-cores and --decode-cores must not overlap", file=sys.stderr)
        return 2
    if ns.local_prefill_queue is not None and (ns.local_prefill_queue < 0 or ns.cluster != "default"):
        print("--local-prefill-queue takes N >= 0, with --cluster default", file=sys.stderr)
        return 2
    if ns.min_rate <= 0:
        print("--min-rate must be > 0 (req/s)", file=sys.stderr)
        return 2
    if ns.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    if ns.cluster == "default" and ns.local_prefill_queue is None:
        ns.local_prefill_queue = DEFAULT_LOCAL_PREFILL_QUEUE
    have = os.sched_getaffinity(0)
    all_cores = sorted(set(ns.prefill_cores_list) | set(ns.decode_cores_list))
    if not set(all_cores) <= have:
        print(f"cores {all_cores} not all available (have {sorted(have)})", file=sys.stderr)
        return 2
    from common.models.default_model import resolve_model_path

    model_dir = resolve_model_path(ns.model)
    ns.model_label = os.path.basename(model_dir.rstrip("/"))
    log_dir = ns.log_dir or os.path.join(os.getcwd(), "logs", time.strftime("compare-%Y%m%d-%H%M%S"))
    os.makedirs(log_dir, exist_ok=True)
    maker = PromptMaker(model_dir, ns.seed)
    requests = build_workload(maker, ns)
    node_args = shlex.split(ns.node_args)

    load_start = round(os.getloadavg()[0], 2)
    signal.signal(signal.SIGTERM, _terminate)  # clean up the children on SIGTERM too
    rates = [float(r) for r in ns.rates.split(",") if r.strip()]

    @functools.cache  # both setups send the same requests: the tokenizer is loaded once per rate and round
    def sweep_requests(round_: int, rate: float) -> list[BenchRequest]:
        # the same requests for both setups, other prompts at each rate and round (no prefix cache hit across
        # rates; each round samples other requests)
        return random_dataset(PromptMaker(model_dir, ns.seed + round(1000 * rate) + 100_003 * round_),
                              ns.sweep_requests, ns.sweep_input_len, ns.sweep_output_len, 0.5)

    runs: dict[str, list[tuple[list[RequestResult], float]]] = {}
    round_sweeps: dict[str, list[list[dict]]] = {}
    served_name = None  # the model name the first setup serves; every request of both setups names it

    def measure(name: str, url: str, round_: int) -> None:
        nonlocal served_name
        served_name = served_name or _served_name(url)
        runs.setdefault(name, []).append(run_setup(name, url, requests, ns, served_name))
        if rates:
            round_sweeps.setdefault(name, []).append(
                sweep(url, served_name, functools.partial(sweep_requests, round_), rates, ns.slo_rate_ttft_ms,
                      ns.slo_rate_tpot_ms, ns.seed, name, ns.min_rate))

    def disaggregated(round_: int, log: str) -> None:
        with disaggregated_setup(ns, node_args, all_cores, os.path.join(log, "disaggregated")) as cluster:
            ns.placement_note = cluster.placement.describe() if ns.cluster == "default" else ""
            measure("disaggregated", cluster.url, round_)

    def colocated(round_: int, log: str) -> None:
        with colocated_node(ns, all_cores, log) as node:
            measure("colocated", node.url, round_)

    setups = {"both": [disaggregated, colocated], "disaggregated": [disaggregated],
              "colocated": [colocated]}[ns.only]
    for i in range(ns.rounds):
        log = os.path.join(log_dir, f"round{i + 1}") if ns.rounds > 1 else log_dir
        os.makedirs(log, exist_ok=True)
        if ns.rounds > 1:
            print(f"\n[bench compare] round {i + 1} of {ns.rounds}", file=sys.stderr, flush=True)
        for run in setups if i % 2 == 0 else setups[::-1]:  # alternate which setup goes first
            run(i, log)
    results = {name: ([r for res, _ in rr for r in res], sum(d for _, d in rr)) for name, rr in runs.items()}
    sweeps = {name: pooled(rounds) for name, rounds in round_sweeps.items()}

    summaries = {name: by_tag(res, dur, ns) for name, (res, dur) in results.items()}
    for name, s in summaries.items():
        for tag, summ in s.items():
            print(format_summary(f"{name}: {tag}", summ))
    ratios: dict[str, float] = {}
    if len(summaries) == 2:
        dis, col = summaries["disaggregated"], summaries["colocated"]
        ratios = compute_ratios(dis, col)
        best = {name: max_rate(points_of(pts)) for name, pts in sweeps.items()}
        if len(best) == 2 and best["colocated"] > 0 and best["disaggregated"] > 0:
            ratios["slo_rate"] = best["disaggregated"] / best["colocated"]
        elif len(best) == 2:
            print(f"note: no slo_rate: highest rates with 90 % attainment {best} (a zero in one setup)",
                  file=sys.stderr)
        missing = sorted({"tpot_p99", "ttft_p99", "goodput"} - set(ratios))
        if missing:
            print(f"note: no ratio for {missing} (a zero or missing figure in one setup)", file=sys.stderr)
        ns.load_note = f"{load_start} / {round(os.getloadavg()[0], 2)}"
        commands = ["pdserve bench compare " + shlex.join(argv)]
        table = markdown_table(dis, col, ns, commands, sweeps, round_sweeps)
        print("\n" + table)
        if ns.markdown:
            with open(ns.markdown, "w") as f:
                f.write(table)
            print(f"wrote {ns.markdown}")
    plot = ns.plot or (ns.json.rsplit(".", 1)[0] + ".png" if ns.json else None)
    if plot:
        plot_cdfs({name: res for name, (res, _) in results.items()}, plot,
                  "disaggregated vs colocated (all requests)")
        print(f"wrote {plot}")
    config = {k: v for k, v in vars(ns).items()}
    config["argv"] = argv
    figures = {"config": config, "summaries": summaries, "log_dir": log_dir,
               "slo_sweep": {name: {"max_rate_90": max_rate(points_of(pts)), "points": pts,
                                    "rounds": [{"max_rate_90": max_rate(points_of(r)), "points": r}
                                               for r in round_sweeps[name]]}
                             for name, pts in sweeps.items()},
               "slo_rate_by_round": slo_rate_by_round(round_sweeps),
               "requests": {name: result_rows(res) for name, (res, _) in results.items()},
               "load_average_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)}}
    write_report(ns.json, "compare", figures, ratios)
    failed = any(s["all"]["completed"] == 0 for s in summaries.values())
    return 1 if failed else 0


def _terminate(signum, _frame) -> None:
    raise KeyboardInterrupt


def _served_name(url: str) -> str:
    from bench.serve import fetch_model_info

    return asyncio.run(fetch_model_info(url))[0]


if __name__ == "__main__":
    sys.exit(main())
