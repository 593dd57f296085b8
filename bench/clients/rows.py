"""The rows of `pdserve bench clients`: each runs one real client against the cluster and says pass or fail.

A row function takes the run's `Context` and its `Row` and returns (ok, detail): detail is one line, the
reason when it failed. Every client runs as a subprocess of its own venv (bench/clients/venvs.py), its
output in `<log-dir>/<row>.log`, offline (HF_HUB_OFFLINE: the tokenizer is a local directory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from bench.clients import venvs

HERE = os.path.dirname(os.path.abspath(__file__))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
WORDS = ("a lighthouse keeper counts the ships that pass each night and writes their names in a book while "
         "the storm outside grows louder and the lamp turns slowly above the dark water of the bay").split()


@dataclass
class Context:
    url: str  # the router
    model: str  # the served model name
    model_dir: str  # the model as a Hugging Face directory: the clients' tokenizer, the reference weights
    model_arg: str  # --model as given ("default", a directory, a .gguf)
    work: str  # a scratch directory for the rows' files
    log_dir: str
    kv_endpoint: str = ""  # the prefill node's KV event sockets
    kv_replay: str = ""


@dataclass
class Row:
    name: str
    group: str  # what --only may name instead of each row
    venvs: tuple[str, ...]
    run: Callable[[Context, Row], tuple[bool, str]]
    args: tuple[str, ...] = ()
    timeout: float = 600.0

    @property
    def client(self) -> str:
        return ", ".join(venvs.SPECS[v].client for v in self.venvs)

    @property
    def version(self) -> str:
        return ", ".join(venvs.SPECS[v].version for v in self.venvs)


def python(name: str) -> str:
    return venvs.SPECS[name].python


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **OFFLINE}


def run_client(ctx: Context, row: Row, cmd: list[str],
               timeout: float | None = None) -> tuple[int | None, str]:
    """Run `cmd` (in the scratch directory, its output appended to the row's log); (exit code or None when it
    ran past the timeout, its output)."""
    log_path = os.path.join(ctx.log_dir, f"{row.name}.log")
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(cmd, cwd=ctx.work, env=client_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout or row.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    with open(log_path, errors="replace") as f:
        f.seek(start)
        return rc, f.read()


def tail(text: str, n: int = 1) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-300:] if lines else "(no output)"


def ended(rc: int | None, out: str, row: Row) -> str | None:
    """The reason a client run failed outright (timed out, or exited non-zero), else None."""
    if rc is None:
        return f"timed out after {row.timeout:.0f} s; last output: {tail(out)}"
    if rc != 0:
        return f"exit {rc}: {tail(out)}"
    return None


# ---------------------------------------------------------------------------------------- check scripts
def checks_row(ctx: Context, row: Row) -> tuple[bool, str]:
    """A `*_checks.py` script: pass iff it exits 0 and every check line says ok."""
    script, *extra = row.args
    cmd = [python(row.venvs[0]), os.path.join(HERE, script), "--base-url",
           ctx.url + "/v1", "--model", ctx.model, *extra]
    rc, out = run_client(ctx, row, cmd)
    results = [json.loads(line) for line in out.splitlines() if line.startswith('{"check"')]
    bad = [r for r in results if not r["ok"]]
    if bad:
        return False, f"{len(bad)}/{len(results)} checks failed: " + "; ".join(
            f"{r['check']}: {r['detail']}" for r in bad)
    if not results:
        return False, f"no check ran ({ended(rc, out, row) or 'exit 0'})"
    if ended(rc, out, row):
        return False, f"every check printed ok but {ended(rc, out, row)}"
    return True, f"{len(results)} checks passed: {', '.join(r['check'] for r in results)}"


# ---------------------------------------------------------------------------------------- bench_serving
BENCH_PROMPTS = 12


def sharegpt_file(ctx: Context) -> str:
    """A small ShareGPT-format file: bench_serving's random dataset takes its prompt tokens from one (it
    would download ShareGPT otherwise)."""
    path = os.path.join(ctx.work, "sharegpt.json")
    convs = []
    for i in range(32):
        text = " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(60))
        convs.append({"conversations": [{"from": "human", "value": f"Story {i}: {text}"},
                                        {"from": "gpt", "value": "The keeper went to sleep."}]})
    with open(path, "w") as f:
        json.dump(convs, f)
    return path


def bench_serving_row(ctx: Context, row: Row) -> tuple[bool, str]:
    """`python -m sglang.bench_serving --backend B`: pass iff every request completed without an error."""
    backend = row.args[0]
    out_file = os.path.join(ctx.work, f"bench_serving-{backend}.jsonl")
    if os.path.exists(out_file):
        os.remove(out_file)
    cmd = [python("sglang"), "-m", "sglang.bench_serving", "--backend", backend, "--base-url", ctx.url,
           "--model", ctx.model, "--tokenizer", ctx.model_dir, "--dataset-name", "random",
           "--dataset-path", sharegpt_file(ctx), "--num-prompts", str(BENCH_PROMPTS),
           "--random-input-len", "128",
           "--random-output-len", "16", "--request-rate", "inf", "--seed", "1", "--output-file", out_file,
           "--output-details", "--disable-tqdm"]
    rc, out = run_client(ctx, row, cmd)
    if not os.path.isfile(out_file):
        return False, f"no --output-file written ({ended(rc, out, row) or 'exit 0'})"
    with open(out_file) as f:
        record = json.loads(f.read().splitlines()[-1])
    errors = [e for e in record.get("errors", []) if e]
    done = record.get("completed", 0)
    if errors or done != BENCH_PROMPTS:
        first = " ".join(str(errors[0]).split())[:300] if errors else "none"
        return False, f"{done}/{BENCH_PROMPTS} requests completed, {len(errors)} errors; first: {first}"
    empty = sum(1 for t in record.get("generated_texts", []) if not t)
    if empty:
        return False, f"{empty}/{BENCH_PROMPTS} requests completed with no text"
    if ended(rc, out, row):
        return False, f"every request completed but {ended(rc, out, row)}"
    return True, (f"{done}/{BENCH_PROMPTS} completed, {record['total_input_tokens']} input and "
                  f"{record['total_output_tokens']} output tokens, no errors")


# ---------------------------------------------------------------------------------------- guidellm
GUIDE_REQUESTS, GUIDE_PROMPT, GUIDE_OUTPUT = 4, 32, 8


def stream_chunks(url: str, body: dict, timeout: float = 60.0) -> list[dict]:
    """The data events of a streamed response to `body`, decoded ([DONE] left out)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


def guidellm_row(ctx: Context, row: Row) -> tuple[bool, str]:
    """guidellm run (synchronous, a few synthetic requests): pass iff every request succeeded with the
    server's
    usage as its token counts, and guidellm's own request bodies, sent again, get usage on every chunk."""
    fmt = row.args[0]
    report_path = os.path.join(ctx.work, f"{row.name}.json")
    cmd = [python("guidellm"), "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={ctx.url},model={ctx.model},request_format={fmt}",
           "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={GUIDE_REQUESTS}",
           "--data", f"kind=synthetic_text,prompt_tokens={GUIDE_PROMPT},output_tokens={GUIDE_OUTPUT}",
           "--tokenizer", f"kind=huggingface_auto,model={ctx.model_dir}",
           "--output", f"kind=json,path={report_path}", "--disable-console-interactive"]
    rc, out = run_client(ctx, row, cmd)
    if ended(rc, out, row) or not os.path.isfile(report_path):
        return False, ended(rc, out, row) or "no report written"
    with open(report_path) as f:
        reqs = json.load(f)["benchmarks"][0]["requests"]
    good, errored, incomplete = reqs["successful"], reqs["errored"], reqs["incomplete"]
    if errored or incomplete or len(good) != GUIDE_REQUESTS:
        first = (errored or incomplete or [{}])[0].get("info", {}).get("error")
        return False, (f"{len(good)}/{GUIDE_REQUESTS} successful, {len(errored)} errored, {len(incomplete)} "
                       f"incomplete; first error: {first}")
    chunks = 0
    for r in good:
        body = json.loads(r["request_args"])["body"]
        if not (body.get("stream_options") or {}).get("continuous_usage_stats"):
            return False, ("guidellm sent no stream_options.continuous_usage_stats: "
                           f"{body.get('stream_options')}")
        got_in, got_out = r["input_metrics"]["text_tokens"], r["output_metrics"]["text_tokens"]
        # guidellm counts tokens only from the server's usage (0 without it); a chat prompt adds its template
        if got_out != GUIDE_OUTPUT or not (got_in == GUIDE_PROMPT if fmt == "/v1/completions" else
                                           got_in > GUIDE_PROMPT):
            return False, (f"token counts from the server's usage: {got_in} in / {got_out} out, expected "
                           f"{'' if fmt == '/v1/completions' else 'more than '}{GUIDE_PROMPT} / "
                           f"{GUIDE_OUTPUT}")
        events = stream_chunks(ctx.url + fmt, body)
        missing = [i for i, ev in enumerate(events) if not ev.get("usage")]
        if missing:
            return False, f"guidellm's request sent again: chunks {missing} of {len(events)} carry no usage"
        chunks += len(events)
    return True, (f"{len(good)}/{GUIDE_REQUESTS} successful, usage {got_in} in / {got_out} out per request; "
                  f"usage on all {chunks} chunks of its requests sent again")


# ---------------------------------------------------------------------------------------- field table
SCOPE_OF = {"GenerateReqInput": "generate", "SamplingParams": "sampling_params",
            "CompletionRequest": "completions",
            "ChatCompletionRequest": "chat", "StreamOptions": "stream_options"}


def field_table_row(ctx: Context, row: Row) -> tuple[bool, str]:
    """Every request field of SGLang's and vLLM's API classes is in the server's table
    (common/api_fields.py)."""
    try:
        from common.api_fields import known_fields
    except ImportError as e:
        return False, f"the server's field table is missing: {e}"
    unknown, counts = [], []
    for venv, package in zip(row.venvs, row.args, strict=True):
        rc, out = run_client(ctx, row, [python(venv), os.path.join(HERE, "field_names.py"), package])
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            return False, f"field_names.py {package}: {ended(rc, out, row) or 'no JSON'}"
        found = json.loads(lines[-1])
        if "error" in found:
            return False, f"field_names.py {package}: {found['error']}"
        n = 0
        for cls, info in found["classes"].items():
            n += len(info["fields"])
            extra = sorted(set(info["fields"]) - known_fields(SCOPE_OF[cls]))
            if extra:
                unknown.append(f"{package}.{cls} ({SCOPE_OF[cls]}): {', '.join(extra)}")
        counts.append(f"{package} {found['version']}: {len(found['classes'])} classes, {n} fields")
    if unknown:
        return False, "not in the server's table: " + "; ".join(unknown)
    return True, "; ".join(counts) + "; every one known"


# ---------------------------------------------------------------------------------------- KV events
def kv_events_row(ctx: Context, row: Row) -> tuple[bool, str]:
    """bench/clients/vllm_kv_events.py in the vLLM venv decodes the prefill node's KV events."""
    script = os.path.join(HERE, "vllm_kv_events.py")
    if not os.path.isfile(script):
        return False, "bench/clients/vllm_kv_events.py does not exist"
    cmd = [python("vllm"), script, "--endpoint", ctx.kv_endpoint, "--replay-endpoint", ctx.kv_replay,
           "--url", ctx.url, "--timeout", "120"]
    rc, out = run_client(ctx, row, cmd)
    lines = [line for line in out.splitlines() if line.startswith("{") and '"ok"' in line]
    if not lines:
        return False, ended(rc, out, row) or "no result line"
    res = json.loads(lines[-1])
    if not res["ok"] or rc != 0:
        return False, f"{res.get('error') or ended(rc, out, row)} (events {res.get('events')})"
    return True, (f"{res['batches']} batches decoded by vLLM's KVEventBatch: {res['events']}; "
                  f"replayed {res['replayed']}")

