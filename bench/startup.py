"""`pdserve bench startup`: how long a node takes to serve, and the CPU its start costs, with the light
tokenizer against transformers' tokenizer.

A colocated node (`pdserve serve`, bench/compare.py's `ColocatedNode`) is started and stopped `--rounds`
times in each of three ways, the ways interleaved, all through `common/server/tokenizer_load.py` as a
user's start goes:

* `first`: no remembered entry for the model's tokenizer: transformers' `AutoTokenizer`, then the check
  of the light tokenizer against it (a new model's first start);
* `transformers`: the entry names transformers' class and says the light one differed: the class is
  loaded directly (every start before the light tokenizer; the reference);
* `light`: the entry says the light one matched: no transformers (every later start since).

The bench writes the entry before each start (`first` deletes it) from what the first start found. A
start is timed from the command to the first 200 of `/health` (the bench's own checks around the
launcher's spawn: they come closer together than the launcher's ready wait); its CPU is the user +
system time of the node's process tree at that moment (front end and scheduler ranks), and of the front
end alone. The log must say the start took the way asked (exit 1 if not, or if the first start's check
failed).

Ratios (transformers / light, higher is better): `startup_cpu_speedup`, `startup_front_end_cpu_speedup`,
`startup_ready_speedup`, on the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.compare import ColocatedNode
from bench.report import write_report

MODES = ("first", "transformers", "light")
LOG_SAYS = {"first": "checked against transformers'", "transformers": "the light one differed at its check",
            "light": "read without transformers"}


def log(msg: str) -> None:
    print(f"[bench startup {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench startup", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="model directory, .gguf, or 'default' (SmolLM2-135M)")
    p.add_argument("--json", default=None, help="write the report to this file")
    p.add_argument("--rounds", type=int, default=5, help="starts of each kind (interleaved)")
    p.add_argument("--log-dir", default=None,
                   help="keep each start's log here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def _tree_cpu(proc: psutil.Process) -> tuple[float, float]:
    """(CPU seconds of `proc` and its descendants, of `proc` alone)."""
    own = proc.cpu_times()
    total = own.user + own.system
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total, own.user + own.system


def start_once(model_dir: str, log_path: str, timeout: float) -> dict:
    """One start of `pdserve serve`, timed from the spawn to the first 200 of /health, then stopped."""
    Path(log_path).unlink(missing_ok=True)  # the log checked afterwards holds this start only
    node = ColocatedNode(model_dir, ["--log-level", "info"], log_path=log_path, startup_timeout=timeout)
    # no step of the launcher's runs in the child before exec (die_with_parent=False), as in a user's start
    t0 = time.perf_counter()
    node.spawn(die_with_parent=False)
    try:
        proc = psutil.Process(node.proc.pid)
        while True:
            if not node.alive():
                raise RuntimeError(f"the node exited with {node.proc.returncode} before serving "
                                   f"(log: {log_path})")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"the node did not serve within {timeout:.0f}s (log: {log_path})")
            if node.is_ready(timeout=1):
                break
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        cpu, front = _tree_cpu(proc)
    finally:
        node.stop(timeout=60)
    return {"ready_s": ready, "cpu_s": cpu, "front_end_cpu_s": front, "log": node.log_text()}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from common.models.default_model import resolve_model_path
    from common.server.tokenizer_load import cache_path, read_entry, write_entry

    model_dir = resolve_model_path(a.model)
    entry_file = cache_path(model_dir, None)
    if entry_file is None:
        log(f"the tokenizer of {model_dir} is never remembered (remote code, or not a directory)")
        return 2
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-startup-")
    os.makedirs(log_dir, exist_ok=True)
    log(f"model {model_dir}; {a.rounds} starts of each kind ({', '.join(MODES)}); logs in {log_dir}")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    truth: dict = {}  # the entry the first start wrote: put back at the end, whatever the bench wrote since
    ok = True
    try:
        for r in range(a.rounds):
            for mode in MODES:
                if mode == "first":
                    if os.path.exists(entry_file):
                        os.remove(entry_file)
                else:
                    write_entry(entry_file, {**truth, "light": mode == "light"})
                run = start_once(model_dir, os.path.join(log_dir, f"{r:02d}-{mode}.log"), a.timeout)
                said = LOG_SAYS[mode] in run.pop("log")
                runs[mode].append(run)
                log(f"round {r + 1}/{a.rounds} {mode}: serving after {run['ready_s']:.2f}s, "
                    f"{run['cpu_s']:.2f}s CPU ({run['front_end_cpu_s']:.2f}s in the front end)"
                    + ("" if said else f" -- ERROR: the log does not say {LOG_SAYS[mode]!r}"))
                if mode == "first":
                    truth = read_entry(entry_file)
                    if not truth.get("light"):
                        log("ERROR: the first start found that the light tokenizer differs from "
                            "transformers'")
                        said = False
                ok = ok and said
                if not ok:
                    break
            if not ok:
                break
    finally:
        if truth:
            write_entry(entry_file, truth)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    figures = {"model": model_dir, "rounds": len(runs["light"]),
               **{mode: {key: {"median": round(med(mode, key), 3),
                               "all": [round(r[key], 3) for r in runs[mode]]}
                         for key in ("ready_s", "cpu_s", "front_end_cpu_s")} for mode in MODES if runs[mode]}}
    ratios = {}
    if runs["light"] and runs["transformers"]:
        ratios = {"startup_cpu_speedup": med("transformers", "cpu_s") / med("light", "cpu_s"),
                  "startup_front_end_cpu_speedup": med("transformers", "front_end_cpu_s")
                  / med("light", "front_end_cpu_s"),
                  "startup_ready_speedup": med("transformers", "ready_s") / med("light", "ready_s")}
    write_report(a.json, "startup", figures, ratios)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
