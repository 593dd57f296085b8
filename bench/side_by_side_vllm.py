"""vLLM CPU and pdserve side by side on one host, the three workloads of bench/README.md interleaved.

    python -m bench.side_by_side_vllm --out DIR [--rounds 6]

Starts the three servers once, each on its own port and on every core: `vllm` (vLLM's OpenAI server, its
OpenMP threads bound to both cores with VLLM_CPU_OMP_THREADS_BIND), `pdserve` (`pdserve serve`, float32)
and `pdserve_w8a8` (`--quantization w8a8_int8`). Then, round after round, each workload goes to the three
servers one after the other (in an order that rotates), so the runs a ratio pairs are seconds apart
instead of minutes: this 2-vCPU host's speed drifts by 10-30 % within minutes, and the pairs then share
the drift. Each round draws its own prompts (`--seed` = the round), the same ones for the three servers,
so no server finds an earlier round's prompt in its prefix cache.

Only one server works at a time: the CPU time each idle server's processes take while another one runs
is recorded per run (`idle_cpu_s`), and the summary gives the largest, which says whether an idle server
(an OpenMP thread that spins, a poll loop) took cores from the one measured. Before the first round,
vLLM's own log must say that its threads were bound to the cores given: its binding lines go to
DIR/vllm_thread_binding.log, and the run stops if they name other cores.

Writes DIR/<server>-<workload>-r<round>.json (`pdserve bench serve` reports, each with its argv), every
log, and DIR/summary.json (a report of bench/results/'s shape, its figures: each round's figures, the
ratios against vLLM round by round with their median, lowest and highest, and the idle CPU); the
markdown tables are printed. Exits 0 when every run
finished with no failed request, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import psutil

from bench.report import machine_info

MODEL = os.path.expanduser("~/.cache/pdserve/SmolLM2-135M-Instruct")
SERVERS = ("vllm", "pdserve", "pdserve_w8a8")
WORKLOADS = {  # bench/README.md's three: name -> `pdserve bench serve` flags
    "single": "--num-prompts 4 --random-input-len 512 --random-output-len 64 --random-range-ratio 1 "
              "--max-concurrency 1",
    "batch16": "--num-prompts 32 --random-input-len 256 --random-output-len 64 --random-range-ratio 1 "
               "--max-concurrency 16",
    "serving": "--num-prompts 40 --random-input-len 256 --random-output-len 32 --random-range-ratio 0.5 "
               "--max-concurrency 8",
}
# (key, what it is, higher is better): the figures of one round taken from its runs' summaries
FIGURES = (
    ("ttft_512_s", "single: TTFT p50 (s)", False),
    ("single_stream_tok_s", "single: 1000 / TPOT p50", True),
    ("batch16_output_tok_s", "batch16: output tok/s", True),
    ("serving_output_tok_s", "serving: output tok/s", True),
)


def server_command(name: str, port: int, ns: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    if name == "vllm":
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": ns.cores, "OMP_NUM_THREADS": "2"}
        return ([ns.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--dtype",
                 "float32", "--port", str(port), "--max-model-len", "2048"], env)
    extra = ["--quantization", "w8a8_int8"] if name == "pdserve_w8a8" else []
    return [ns.pdserve, "serve", "--model", "default", "--port", str(port), *extra], {}


def up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def cpu_seconds(proc: subprocess.Popen) -> float:
    """User + system CPU time of a server's process and all its descendants, now."""
    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def check_binding(log_path: str, out_path: str, cores: str) -> bool:
    """vLLM's "OpenMP thread binding info" lines to `out_path`; whether they bind it to `cores`."""
    lines = [ln for ln in open(log_path, errors="replace") if "ompmultiprocessing" in ln]
    with open(out_path, "w") as f:
        f.writelines(lines)
    lo, _, hi = cores.partition("-")
    want = list(range(int(lo), int(hi or lo) + 1))
    return any(f"core ids={want}" in ln for ln in lines)


def round_figures(out: str, name: str, r: int) -> dict | None:
    s = {}
    for w in WORKLOADS:
        path = os.path.join(out, f"{name}-{w}-r{r}.json")
        if not os.path.exists(path):
            return None
        s[w] = json.load(open(path))["figures"]["summary"]
    return {"ttft_512_s": s["single"]["ttft_ms"]["p50"] / 1e3,
            "single_stream_tok_s": 1000 / s["single"]["tpot_ms"]["p50"],
            "batch16_output_tok_s": s["batch16"]["output_throughput"],
            "serving_output_tok_s": s["serving"]["output_throughput"],
            "serving_ttft_p50_s": s["serving"]["ttft_ms"]["p50"] / 1e3,
            "serving_ttft_p99_s": s["serving"]["ttft_ms"]["p99"] / 1e3,
            "serving_tpot_p50_ms": s["serving"]["tpot_ms"]["p50"],
            "serving_tpot_p99_ms": s["serving"]["tpot_ms"]["p99"],
            "failed": sum(x["failed"] for x in s.values())}


def summarize(out: str, rounds: list[int], idle: list[dict]) -> dict:
    figs = {n: {r: round_figures(out, n, r) for r in rounds} for n in SERVERS}
    done = [r for r in rounds if all(figs[n][r] for n in SERVERS)]
    ratios = {}
    for n in SERVERS[1:]:
        ratios[n] = {}
        for key, _, _ in FIGURES:
            rs = [figs[n][r][key] / figs["vllm"][r][key] for r in done]
            ratios[n][key] = {"median": round(statistics.median(rs), 3), "lowest": round(min(rs), 3),
                              "highest": round(max(rs), 3), "rounds": [round(x, 3) for x in rs]}
    return {"bench": "side_by_side_vllm", "machine": machine_info(), "ratios": {},
            "figures": {"rounds": done, "by_round": {n: {str(r): figs[n][r] for r in done} for n in SERVERS},
                        "ratios_vs_vllm": ratios,
                        "idle_cpu_s_max": max((x["idle_cpu_s"] for x in idle), default=None), "runs": idle}}


def tables(summary: dict) -> str:
    summary = summary["figures"]
    done = summary["rounds"]
    rows = ["| server | TTFT 512 p50 (s) | single-stream decode (tok/s) | 16-concurrent output (tok/s) | "
            "serving output (tok/s) | serving TTFT p50 / p99 (s) | serving TPOT p50 / p99 (ms) |",
            "|---|---|---|---|---|---|---|"]
    for n in SERVERS:
        f = [summary["by_round"][n][str(r)] for r in done]

        def span(k, fmt="%.2f", f=f):
            return (fmt % min(x[k] for x in f)) + "–" + (fmt % max(x[k] for x in f))

        def med(k, fmt="%.2f", f=f):
            return fmt % statistics.median(x[k] for x in f)

        rows.append(f"| {n} | {span('ttft_512_s')} | {span('single_stream_tok_s', '%.1f')} | "
                    f"{span('batch16_output_tok_s', '%.1f')} | {span('serving_output_tok_s', '%.1f')} | "
                    f"{med('serving_ttft_p50_s')} / {med('serving_ttft_p99_s')} | "
                    f"{med('serving_tpot_p50_ms', '%.0f')} / {med('serving_tpot_p99_ms', '%.0f')} |")
    rows += ["", "| server | " + " | ".join(f"{label} vs vLLM" for _, label, _ in FIGURES) + " |",
             "|---|" + "---|" * len(FIGURES)]
    for n in SERVERS[1:]:
        cells = []
        for key, _, _ in FIGURES:
            x = summary["ratios_vs_vllm"][n][key]
            cells.append(f"{x['median']:.2f} ({x['lowest']:.2f}–{x['highest']:.2f}): "
                         + " / ".join(f"{v:.2f}" for v in x["rounds"]))
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.side_by_side_vllm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/sbs", help="folder for the reports and logs")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python", help="the python of vLLM's venv")
    p.add_argument("--pdserve", default=os.path.join(os.path.dirname(sys.executable), "pdserve"))
    p.add_argument("--cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND: the cores pdserve uses too")
    p.add_argument("--port", type=int, default=30100, help="vllm's port; pdserve's the next two")
    ns = p.parse_args(argv)
    out = ns.out
    os.makedirs(out, exist_ok=True)
    ports = {n: ns.port + i for i, n in enumerate(SERVERS)}
    procs: dict[str, subprocess.Popen] = {}
    ok = True
    try:
        for n in SERVERS:
            cmd, env = server_command(n, ports[n], ns)
            log = open(os.path.join(out, f"{n}-server.log"), "w")
            procs[n] = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            deadline = time.time() + 600
            while not up(ports[n]):  # one at a time: their start-ups would slow each other
                if procs[n].poll() is not None or time.time() > deadline:
                    print(f"{n} did not start (its log: {log.name})", file=sys.stderr)
                    return 1
                time.sleep(1)
            print(f"{time.strftime('%T')} {n} up on port {ports[n]}", flush=True)
        binding = os.path.join(out, "vllm_thread_binding.log")
        if not check_binding(os.path.join(out, "vllm-server.log"), binding, ns.cores):
            print(f"vLLM's log does not bind its threads to cores {ns.cores}: see vllm_thread_binding.log",
                  file=sys.stderr)
            return 1
        idle = []
        for r in range(1, ns.rounds + 1):
            for wi, (w, flags) in enumerate(WORKLOADS.items()):
                k = (r + wi) % len(SERVERS)
                for n in SERVERS[k:] + SERVERS[:k]:
                    base = os.path.join(out, f"{n}-{w}-r{r}")
                    before = {m: cpu_seconds(procs[m]) for m in SERVERS if m != n}
                    t0 = time.time()
                    cmd = [ns.pdserve, "bench", "serve", "--base-url", f"http://127.0.0.1:{ports[n]}",
                           "--tokenizer", MODEL, "--disable-tqdm", "--seed", str(r), *flags.split(),
                           "--json", base + ".json"]
                    with open(base + ".log", "w") as log:
                        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
                    others = {m: round(cpu_seconds(procs[m]) - before[m], 3) for m in before}
                    idle.append({"server": n, "workload": w, "round": r, "rc": rc,
                                 "seconds": round(time.time() - t0, 1), "idle_cpu_s": max(others.values()),
                                 "idle_cpu_by_server": others})
                    ok = ok and rc == 0
                    print(f"{time.strftime('%T')} round {r} {w} {n}: rc {rc}, idle servers' CPU {others}",
                          flush=True)
        summary = summarize(out, list(range(1, ns.rounds + 1)), idle)
        fig = summary["figures"]
        ok = ok and len(fig["rounds"]) == ns.rounds and all(
            fig["by_round"][n][str(r)]["failed"] == 0 for n in SERVERS for r in fig["rounds"])
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(tables(summary))
        print(f"largest CPU time of an idle server during another's run: {fig['idle_cpu_s_max']} s")
        return 0 if ok else 1
    finally:
        for proc in procs.values():
            with_group(proc, signal.SIGTERM)
        time.sleep(3)
        for proc in procs.values():
            with_group(proc, signal.SIGKILL)


def with_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
