"""`pdserve bench clients`: real, unmodified clients against a pdserve cluster, one pass/fail row each.

    pdserve bench clients                          # every row; bench/results/clients.json
    pdserve bench clients --only openai,bench_serving --json /tmp/clients.json

starts `pdserve cluster --prefill 1 --decode 1`'s cluster (deploy.cluster.Cluster: nixl, automatic
placement, conditional disaggregation; the prefill node also publishes KV events when the vllm-kv-events
row runs), then runs each row's client from its own venv (bench/clients/venvs.py: built on first use,
then reused) with a timeout, one log line per row. `--only` takes row names or groups (`bench_serving`,
`guidellm`). The JSON report (bench/report.py) has `figures.rows`: row, client, version, ok, seconds,
detail (the reason, when it failed). Exit code 0 iff every row passed. bench/README.md, "Real clients",
says what each row checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.request

from bench.clients import venvs
from bench.clients.lm_eval_row import lm_eval_row
from bench.clients.rows import (
    Context,
    Row,
    bench_serving_row,
    checks_row,
    field_table_row,
    guidellm_row,
    kv_events_row,
)
from bench.report import HelpFormatter, machine_info, save_json

ROWS = [
    *(Row(f"bench_serving-{b}", "bench_serving", ("sglang",), bench_serving_row, (b,), timeout=300)
      for b in ("sglang", "sglang-oai", "sglang-oai-chat", "vllm", "vllm-chat")),
    Row("guidellm-completions", "guidellm", ("guidellm",), guidellm_row, ("/v1/completions",), timeout=300),
    Row("guidellm-chat", "guidellm", ("guidellm",), guidellm_row, ("/v1/chat/completions",), timeout=300),
    Row("openai", "openai", ("openai",), checks_row,
        ("openai_checks.py", "--expect-reasoning-effort", "refused"), timeout=300),
    Row("langchain", "langchain", ("langchain",), checks_row, ("langchain_checks.py",), timeout=300),
    Row("litellm", "litellm", ("litellm",), checks_row, ("litellm_checks.py",), timeout=300),
    Row("lm-eval", "lm-eval", ("lm-eval",), lm_eval_row, timeout=600),
    Row("vllm-kv-events", "vllm-kv-events", ("vllm",), kv_events_row, timeout=300),
    Row("field-table", "field-table", ("sglang", "vllm"), field_table_row, ("sglang", "vllm"), timeout=120),
]


def say(msg: str) -> None:
    print(f"clients: {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench clients", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--only", default="", metavar="ROWS",
                   help="comma list of rows or groups: " + ", ".join(dict.fromkeys(
                       [r.group for r in ROWS] + [r.name for r in ROWS])))
    p.add_argument("--json", default="bench/results/clients.json", metavar="FILE", help="the report")
    p.add_argument("--model", default="default", help="what the cluster serves (`pdserve cluster --model`)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--keep-venvs", action="store_true",
                       help="use a venv that exists as it is, even one built from an older spec")
    which.add_argument("--rebuild", action="store_true", help="build every venv the rows need afresh")
    p.add_argument("--log-dir", default=None,
                   help="the cluster's and every client's logs (default ./logs/clients-<timestamp>)")
    return p


def select(only: str) -> list[Row]:
    names = [n for n in only.split(",") if n]
    known = {r.name for r in ROWS} | {r.group for r in ROWS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--only: no such row or group: {', '.join(unknown)}")
    return [r for r in ROWS if not names or r.name in names or r.group in names]


def served_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def run_rows(rows: list[Row], ctx: Context, broken: dict[str, str]) -> list[dict]:
    out = []
    for row in rows:
        t0 = time.time()
        bad = [f"venv {v}: {broken[v]}" for v in row.venvs if v in broken]
        if bad:
            ok, detail = False, "; ".join(bad)
        else:
            try:
                ok, detail = row.run(ctx, row)
            except Exception as e:  # a client's output this bench did not expect: the row fails, saying so
                ok, detail = False, f"{type(e).__name__}: {e}"
        seconds = round(time.time() - t0, 1)
        say(f"row={row.name} ok={ok} ({seconds} s) {detail}")
        out.append({"row": row.name, "client": row.client, "version": row.version,
                    "ok": ok, "seconds": seconds, "detail": detail})
    return out


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    try:
        rows = select(ns.only)
    except ValueError as e:
        print(f"clients: error: {e}", file=sys.stderr)
        return 2
    from common.models.default_model import resolve_model_path
    from deploy.cluster import DEFAULT_LOCAL_PREFILL_QUEUE, Cluster
    from deploy.procs import ClusterError, free_port

    log_dir = os.path.abspath(ns.log_dir or os.path.join("logs", time.strftime("clients-%Y%m%d-%H%M%S")))
    work = os.path.join(log_dir, "work")
    os.makedirs(work, exist_ok=True)
    say(f"{len(rows)} rows: {', '.join(r.name for r in rows)}; logs in {log_dir}; venvs in {venvs.ROOT}")
    broken = {}
    for name in dict.fromkeys(v for r in rows for v in r.venvs):
        try:
            venvs.build(name, rebuild=ns.rebuild, keep=ns.keep_venvs)
        except (RuntimeError, OSError, ValueError) as e:
            broken[name] = str(e)
            say(f"venv {name} failed to build: {e}")
    kv_port = free_port()
    kv_args = []
    if any(r.name == "vllm-kv-events" for r in rows):
        kv_args = ["--kv-events-config", json.dumps({"endpoint": f"tcp://127.0.0.1:{kv_port}",
                                                     "replay_endpoint": f"tcp://127.0.0.1:{kv_port + 1}"})]
    cluster = Cluster(num_prefill=1, num_decode=1, model=ns.model, transfer_backend="nixl", log_dir=log_dir,
                      auto_placement=True,
                      local_prefill_queue=DEFAULT_LOCAL_PREFILL_QUEUE, prefill_args=kv_args)
    t0 = time.time()
    try:
        cluster.start()
    except ClusterError as e:
        say(f"the cluster did not start: {e}")
        return 1
    try:
        say(f"cluster up in {time.time() - t0:.0f} s at {cluster.url}")
        ctx = Context(url=cluster.url, model=served_name(cluster.url), model_dir=resolve_model_path(ns.model),
                      model_arg=ns.model, work=work, log_dir=log_dir, kv_endpoint=f"tcp://127.0.0.1:{kv_port}",
                      kv_replay=f"tcp://127.0.0.1:{kv_port + 1}")
        results = run_rows(rows, ctx, broken)
    finally:
        cluster.stop()
    passed = sum(r["ok"] for r in results)
    say(f"{passed}/{len(results)} rows passed" + "".join(f"; FAILED {r['row']}"
                                                         for r in results if not r["ok"]))
    report = {"bench": "clients", "machine": machine_info(),
              "command": "pdserve bench clients " + shlex.join(argv),
              "config": {"model": ns.model, "cluster": "1 prefill + 1 decode, nixl, automatic placement",
                         "log_dir": log_dir, "venvs": venvs.ROOT},
              "figures": {"rows": results, "passed": passed, "failed": len(results) - passed},
              "ratios": {}, "ok": passed == len(results)}
    save_json(ns.json, report)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
