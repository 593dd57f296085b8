"""`pdserve bench gpu`: decode and prefill of the GPU engine against the device's own roofline.

Usage:

    pdserve bench gpu --json bench/results/gpu.json                       # Llama-3.1-8B's shape, bf16, cuda
    pdserve bench gpu --backends triton --batches 1,64 --context 2048
    pdserve bench gpu --shape tiny --device cpu --backends torch_native    # a smoke run on a CPU

The model is random weights (`load_format="dummy"`: built on the device from config.json alone, which the
bench writes into a temporary directory; nothing is downloaded) of Llama-3.1-8B's shape (hidden 4096, 32
layers, 32 query and 8 KV heads of 128, MLP 14336, vocabulary 128256, llama3 rope scaling, 131072
positions) in bfloat16; `--shape tiny` is a tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim
16, vocabulary 512) in float32, for smoke runs. Every figure runs through the real `ModelRunner`, as the
scheduler drives it (`bench/engine.py`'s `OurEngine` is the CPU counterpart).

References, measured first, in the same run, on the same device:

* copy bandwidth: a device-to-device copy of a large buffer, bytes read + written / time, best of several
  (CUDA events on cuda, `perf_counter` on cpu): the rate at which a decode step can stream its weights
  and KV;
* matmul rate: a square matmul (8192^3 in bfloat16 on cuda; 512^3 in float32 on cpu), best of several.

Decode, per backend of `--backends` (one whose package is missing, or that cannot run on the device, is
recorded as skipped with the reason): one runner, built once (on cuda with its decode graphs captured up
to the largest batch, where the backend can run in a graph) and used for every batch, with CUDA graphs
and then without them (the runner's `graphs` set aside, as `disable_cuda_graph` builds it; on cpu, or
for a backend without graph support, eager only, and its `backends` entry says why). The
backends run one after the other, so only one runner holds the device's memory. The runner prefills
max(`--batches`) requests of `--context` random tokens once (EXTEND forwards of at most
`bench/gpu/workload.py`'s `PREFILL_CHUNK_TOKENS` tokens); batch b then decodes the first b of them: `--warmup`
steps, then
`--decode-steps` timed steps, best of `--repeats`, every run from the same context (the decode steps' KV
slots are reused). A step is the runner's forward (a graph replay or eager) and greedy sampling on the
device, the sampled tokens fed back as the next step's input without a trip to the host. Every KV slot of
the decode steps is allocated and in `req_to_token` before the timing: the scheduler's host bookkeeping
is not part of a step here (`pdserve bench engine` measures the scheduler loop).

Roofline time of a step: (the weight bytes a step reads + the K and V bytes of the b requests over the
step's context) / the copy bandwidth. The weights are every layer's projections and norms, the final
norm and the lm_head (the embedding is a lookup of b rows, unless it is the tied lm_head); the context
is `--context` plus the mean of the timed steps' positions. Ratio = roofline time / measured time.

Prefill: one request of `--prefill-tokens` tokens per backend (eager: graphs are for decode), best of
`--repeats`. FLOPs = 2 x the weights each prompt token is multiplied by (the layers' projections) x tokens
+ 2 x the lm_head (the runner projects the last position only) + causal attention, 4 x layers x heads x
head_dim x tokens^2 / 2; TFLOP/s = FLOPs / time; ratio = TFLOP/s / the matmul rate.

Overlap (`--overlap-batches`, default 1 and 16): on triton on cuda (the engine's default there; else the
first backend asked for), decode through the real
scheduler loop with overlap scheduling on and off (`bench/overlap.py`, as `pdserve bench engine` does on
a CPU), tokens identical; ratios `overlap_b<B>` (and `overlap_free_core_b<B>` when the bench's torch
threads take every core), no target: what overlap gains with a device to overlap with.

Ratios, with their targets: `decode_b1_roofline` (0.75) and `decode_b64_roofline` (0.6): the best
backend's ratio at batch 1 and 64 with CUDA graphs (eager where the device has no graphs);
`prefill_8k_peak` (0.6): the best backend's prefill ratio. Each says its value, target, whether it was
met and which backend it came from; a missed target is a result, not an error (exit 0).

JSON (`--json FILE`, rewritten after each backend, so a run cut short keeps what it measured):
`bench`, `device` (name, memory, torch / triton / CUDA versions; on cpu the CPU model), `machine`,
`command` (the argv), `config`, `ratios`, and under `figures`: `references` (copy GB/s, matmul TFLOP/s),
`backends` (measured, or skipped with the reason), `decode` rows (backend, graphs, batch, context, steps,
step_ms, tokens_per_s, weight_bytes, kv_bytes, roofline_ms, ratio), `prefill` rows (backend, tokens, ms,
flops, tflops, ratio) and `overlap`. Progress goes to stderr, one line per event; the table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

from bench.gpu.workload import Workload, sync
from bench.report import as_result, machine_info, save_json

PAGE = 16
BACKENDS = ("torch_native", "triton", "flashinfer")
TARGETS = {"decode_b1_roofline": 0.75, "decode_b64_roofline": 0.6, "prefill_8k_peak": 0.6}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "llama8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, intermediate_size=14336, vocab_size=128256, torch_dtype="bfloat16"),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=512, torch_dtype="float32"),
}
PACKAGES = {"triton": "triton", "flashinfer": "flashinfer"}  # backend -> the module it needs


def log(msg: str) -> None:
    print(f"[bench gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"backends are a comma-separated subset of {', '.join(BACKENDS)}; "
                                         f"got {text!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench gpu", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama8b",
                   help="llama8b: Llama-3.1-8B's shape in bfloat16; tiny: a tiny Llama in float32")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when there is one")
    p.add_argument("--backends", type=_names, default=list(BACKENDS),
                   help="attention backends, comma-separated")
    p.add_argument("--batches", type=_ints, default=[1, 16, 64, 256],
                   help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request before decoding")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before each batch's runs")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the one-request prefill")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement (the best is kept)")
    p.add_argument("--overlap-batches", type=lambda t: _ints(t) if t else [], default=[1, 16],
                   help="decode batches run through the scheduler loop with overlap scheduling on and off, "
                        "with triton on cuda, else the first backend (comma-separated; empty: none)")
    p.add_argument("--json", default=None, help="write the report to this file")
    args = p.parse_args(argv)
    if args.context < 1 or args.prefill_tokens < 1:
        p.error("--context and --prefill-tokens must be >= 1")
    if args.decode_steps < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--decode-steps and --repeats must be >= 1, --warmup >= 0")
    if args.warmup > args.decode_steps:
        p.error("--warmup must not exceed --decode-steps (the warmup steps reuse the timed steps' KV slots)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if args.device == "cpu" and args.shape != "tiny":
        p.error("--shape llama8b runs in bfloat16 on cuda; on cpu use --shape tiny")
    return args


def write_config(model_dir: str, shape: str) -> dict:
    """config.json of a Llama of `shape` (all the dummy load reads)."""
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
               rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


# ---------------------------------------------------------------------------------------------- device
def device_line(device: torch.device) -> dict:
    out = {"type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda}
    spec = importlib.util.find_spec("triton")
    if spec is not None:
        import triton

        out["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=torch.cuda.get_device_name(device), memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count)
    else:
        out["name"] = machine_info()["cpu"]
    return out


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `fn` (after one untimed call): CUDA events on cuda."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gbps(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by a `nbytes` device-to-device copy, the best of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds / 1e9


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), device, repeats)
    return 2 * n ** 3 / seconds / 1e12


# ---------------------------------------------------------------------------------------------- counts
def weight_counts(cfg) -> dict:
    """Weights of a Llama `ModelConfig`, as numbers: `layers` (every layer's projections and norms, the final
    norm), `projections` (the layers' matmul weights alone), `lm_head` and `embedding`."""
    h, hd = cfg.hidden_size, cfg.head_dim
    proj = h * cfg.num_heads * hd * 2 + 2 * h * cfg.num_kv_heads * hd + 3 * h * cfg.intermediate_size
    layers = cfg.num_layers * (proj + 2 * h) + h
    lm = cfg.vocab_size * h
    return {"layers": layers, "projections": cfg.num_layers * proj, "lm_head": lm,
            "embedding": 0 if cfg.tie_word_embeddings else lm}


def decode_weight_bytes(cfg, element_size: int) -> int:
    """Bytes of the weights one decode step reads (a tied embedding is the lm_head and counts once)."""
    c = weight_counts(cfg)
    return (c["layers"] + c["lm_head"]) * element_size


def kv_bytes_per_token(pool) -> int:
    return len(pool.layer_ids) * 2 * pool.kv_heads * pool.head_dim * pool.data.element_size()


def prefill_flops(cfg, tokens: int) -> float:
    c = weight_counts(cfg)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2
    return 2 * c["projections"] * tokens + 2 * c["lm_head"] + attention


def backend_unavailable(name: str, device: torch.device) -> str | None:
    """Why `name` cannot run here, or None."""
    module = PACKAGES.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        package = "flashinfer-python" if name == "flashinfer" else name
        return f"the {package} package is not installed"
    if name == "flashinfer" and device.type != "cuda":
        return "flashinfer runs on cuda only"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton on cpu needs TRITON_INTERPRET=1 (set before the kernels are imported)"
    return None


def supports_graphs(backend: str, device: torch.device) -> bool:
    """Whether `backend` can run decode steps inside a CUDA graph on `device` (asked of a small instance
    from the backend factory, before the runner would try to capture with it)."""
    if device.type != "cuda":
        return False
    from common.layers.attention_backend import create_attention_backend

    return bool(create_attention_backend(backend, 1, 1, 16, device=device).supports_cuda_graph)


def build_runner(model_dir: str, args, backend: str, dtype: str, graphs: bool = True):
    from common.config import ServerArgs
    from common.runner import ModelRunner

    requests = max([*args.batches, *args.overlap_batches])  # the overlap runs' requests reuse the same memory
    per_req = -(-(args.context + args.decode_steps) // PAGE) * PAGE
    long_req = -(-args.prefill_tokens // PAGE) * PAGE
    server_args = ServerArgs(
        model=model_dir, load_format="dummy", device=args.device, dtype=dtype, attention_backend=backend,
        disable_cuda_graph=not graphs, cuda_graph_max_bs=requests, max_running_requests=requests,
        max_total_tokens=requests * per_req + long_req + PAGE, page_size=PAGE,
        context_length=max(args.context + args.decode_steps, args.prefill_tokens) + PAGE)
    return ModelRunner(server_args, model_dir)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- main
def measure_backend(model_dir: str, args, backend: str, dtype: str, report: dict) -> dict:
    """Decode rows (with and without graphs) and the prefill row of one backend, into `report`; returns what
    the report's `backends` entry says of it."""
    device = torch.device(args.device)
    bw = report["references"]["copy_gbps"]
    t0 = time.perf_counter()
    capture = supports_graphs(backend, device)
    runner = build_runner(model_dir, args, backend, dtype, graphs=capture)
    graphs = runner.graphs  # None on cpu, and for a backend that cannot run in a graph
    info = {"status": "measured", "build_s": round(time.perf_counter() - t0, 1),
            "cuda_graph_batch_sizes": list(graphs.batch_sizes) if graphs is not None else []}
    if device.type == "cuda" and not capture:
        info["cuda_graphs"] = f"the {backend} backend cannot run in a CUDA graph: eager rows only"
    log(f"{backend}: runner built in {info['build_s']:.1f} s"
        + (f", graphs for batches {info['cuda_graph_batch_sizes']}" if graphs is not None
           else ", no cuda graphs"))
    work = Workload(runner, max(args.batches), args.context, args.decode_steps, args.prefill_tokens)
    t0 = time.perf_counter()
    work.prefill_contexts()
    log(f"{backend}: {max(args.batches)} contexts of {args.context} tokens prefilled in "
        f"{time.perf_counter() - t0:.1f} s")
    cfg = runner.model_config
    wbytes = decode_weight_bytes(cfg, torch.empty(0, dtype=getattr(torch, dtype)).element_size())
    per_token = kv_bytes_per_token(runner.kv_pool)
    try:
        for with_graphs in ((True, False) if graphs is not None else (False,)):
            # eager: the runner as `disable_cuda_graph` builds it, which keeps no graphs
            runner.graphs = graphs if with_graphs else None
            label = f"{backend}, {'cuda graphs' if with_graphs else 'eager'}"
            for b in sorted(args.batches):
                times = work.decode(b, args.warmup, args.repeats)
                step_s = min(times) / args.decode_steps
                kv = b * (args.context + (args.decode_steps + 1) / 2) * per_token
                roof_s = (wbytes + kv) / (bw * 1e9)
                row = {"backend": backend, "graphs": with_graphs, "batch": b, "context": args.context,
                       "steps": args.decode_steps, "step_ms": step_s * 1e3, "tokens_per_s": b / step_s,
                       "weight_bytes": wbytes, "kv_bytes": int(kv), "roofline_ms": roof_s * 1e3,
                       "ratio": roof_s / step_s,
                       "runs_ms": [round(t * 1e3 / args.decode_steps, 4) for t in times]}
                report["decode"].append(row)
                log(f"{label}: decode b{b} {row['step_ms']:.3f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
                    f"roofline {row['roofline_ms']:.3f} ms, ratio {row['ratio']:.3f}")
    finally:
        runner.graphs = graphs
    times = work.prefill(args.repeats)
    flops = prefill_flops(cfg, args.prefill_tokens)
    tflops = flops / min(times) / 1e12
    row = {"backend": backend, "tokens": args.prefill_tokens, "ms": min(times) * 1e3, "flops": flops,
           "tflops": tflops, "ratio": tflops / report["references"]["matmul_tflops"],
           "runs_ms": [round(t * 1e3, 3) for t in times]}
    report["prefill"].append(row)
    log(f"{backend}: prefill {args.prefill_tokens} tokens {row['ms']:.1f} ms, {tflops:.3g} TFLOP/s, "
        f"ratio {row['ratio']:.3f}")
    work.release()
    if args.overlap_batches and backend == overlap_backend(args, device):
        report["overlap"] = measure_overlap(runner, model_dir, args, backend)
    del work, runner, graphs
    release(device)
    return info


def overlap_backend(args, device: torch.device) -> str:
    """Where overlap is measured: the engine's own choice on cuda (triton) when it is asked for, else the
    first backend asked for."""
    return "triton" if device.type == "cuda" and "triton" in args.backends else args.backends[0]


def measure_overlap(runner, model_dir: str, args, backend: str) -> dict:
    """Decode through the real scheduler loop with overlap scheduling on and off (`bench/overlap.py`), on
    this runner: with a device to run the forward, the loop's host work can hide behind it. Ratio
    `overlap_b<B>` = step time in sequence / overlapped (higher is better)."""
    from bench.overlap import measure

    g = torch.Generator().manual_seed(1)
    low = min(100, runner.vocab_size // 2)
    prompts = {b: torch.randint(low, runner.vocab_size, (b, args.context), generator=g).tolist()
               for b in sorted(args.overlap_batches)}
    figures, ratios = measure(runner, model_dir, prompts, args.decode_steps, args.repeats, log)
    return {"backend": backend, "graphs": runner.graphs is not None, "figures": figures, "ratios": ratios}


def summarize(report: dict) -> dict:
    """The three headline ratios from the rows: the best backend's, with graphs where any row has them."""
    decode = report["decode"]
    graphs = any(r["graphs"] for r in decode)
    out = {}
    for key, batch in (("decode_b1_roofline", 1), ("decode_b64_roofline", 64)):
        rows = [r for r in decode if r["batch"] == batch and r["graphs"] == graphs]
        best = max(rows, key=lambda r: r["ratio"], default=None)
        out[key] = _ratio(key, best, graphs=graphs)
    best = max(report["prefill"], key=lambda r: r["ratio"], default=None)
    out["prefill_8k_peak"] = _ratio("prefill_8k_peak", best)
    overlap = report.get("overlap")
    for key, value in (overlap["ratios"] if overlap else {}).items():
        out[key] = {"value": round(value, 4), "target": None, "met": None, "backend": overlap["backend"]}
    return out


def _ratio(key: str, row: dict | None, **extra) -> dict:
    value = None if row is None else round(row["ratio"], 4)
    return {"value": value, "target": TARGETS[key], "met": value is not None and value >= TARGETS[key],
            "backend": None if row is None else row["backend"], **extra}


def print_table(report: dict) -> None:
    ref = report["references"]
    print(f"\ngpu bench: {report['device']['name']}, copy {ref['copy_gbps']:.0f} GB/s, matmul "
          f"{ref['matmul_tflops']:.3g} TFLOP/s")
    print(f"  {'backend':13s} {'graphs':>6s} {'batch':>5s} {'ms/step':>9s} {'tok/s':>10s} {'roofline':>9s} "
          f"{'ratio':>6s}")
    for r in report["decode"]:
        print(f"  {r['backend']:13s} {str(r['graphs']):>6s} {r['batch']:5d} {r['step_ms']:9.3f} "
              f"{r['tokens_per_s']:10.0f} {r['roofline_ms']:9.3f} {r['ratio']:6.3f}")
    for r in report["prefill"]:
        print(f"  prefill {r['backend']:13s} {r['tokens']} tokens: {r['ms']:.1f} ms, {r['tflops']:.3g} "
              f"TFLOP/s, ratio {r['ratio']:.3f}")
    for name, b in report["backends"].items():
        if b["status"] == "skipped":
            print(f"  {name}: skipped ({b['reason']})")
    for key, v in report["ratios"].items():
        shown = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        source = v["backend"] or "not measured"
        verdict = "no target" if v["target"] is None \
            else f"target {v['target']}, {'met' if v['met'] else 'missed'}"
        print(f"  {key}: {shown} ({verdict}; {source})")


def main(argv: list[str] | None = None) -> int | dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = SHAPES[args.shape]["torch_dtype"]
    report = {"bench": "gpu", "device": device_line(device), "machine": machine_info(),
              "command": ["pdserve", "bench", "gpu", *argv],
              "config": {"shape": args.shape, "dtype": dtype, "batches": sorted(args.batches),
                         "context": args.context, "decode_steps": args.decode_steps, "warmup": args.warmup,
                         "prefill_tokens": args.prefill_tokens, "repeats": args.repeats, "page_size": PAGE},
              "references": {}, "backends": {}, "decode": [], "prefill": [], "ratios": {}}
    log(f"device {report['device']['name']} ({device.type}), shape {args.shape} in {dtype}, backends "
        f"{','.join(args.backends)}, batches {','.join(map(str, sorted(args.batches)))}, context "
        f"{args.context}")
    cuda = device.type == "cuda"
    gbps = copy_bandwidth_gbps(device, 2**30 if cuda else 64 * 2**20)
    tflops = matmul_tflops(device, getattr(torch, dtype) if cuda else torch.float32, 8192 if cuda else 512)
    report["references"] = {"copy_gbps": gbps, "copy_bytes": 2**30 if cuda else 64 * 2**20,
                            "matmul_tflops": tflops, "matmul_n": 8192 if cuda else 512,
                            "matmul_dtype": dtype if cuda else "float32"}
    log(f"references: copy {gbps:.1f} GB/s (read + written), matmul {tflops:.3g} TFLOP/s")
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-gpu-") as model_dir:
        write_config(model_dir, args.shape)
        for backend in args.backends:
            reason = backend_unavailable(backend, device)
            if reason is not None:
                report["backends"][backend] = {"status": "skipped", "reason": reason}
                log(f"{backend}: skipped, {reason}")
                continue
            t0 = time.perf_counter()
            info = measure_backend(model_dir, args, backend, dtype, report)
            report["backends"][backend] = {**info, "seconds": round(time.perf_counter() - t0, 1)}
            report["ratios"] = summarize(report)
            save_json(args.json, as_result(report))
    report["ratios"] = summarize(report)
    print_table(report)
    save_json(args.json, as_result(report))
    if not report["decode"]:
        log("no backend could run here: nothing was measured")
        return 1
    return report


if __name__ == "__main__":
    rc = main()
    sys.exit(rc if isinstance(rc, int) else 0)
