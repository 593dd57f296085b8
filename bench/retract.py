"""`pdserve bench retract`: what keeping a retracted request's KV in the host store saves.

A retraction-heavy workload runs through the real scheduler and runner, in process, twice on the same
model and pools: with the host KV store off (`--decode-offload-size 0`: a retracted request re-prefills
prompt + output) and on (its pages are copied out and back, and it resumes decoding). `--requests`
greedy requests of `--prompt-len` tokens and `--max-new-tokens` each arrive at once on a KV pool of
`--max-total-tokens` (default 30 % of what they need together), and a low new-token ratio admits them
eagerly, so decode keeps running out of KV and retracting (the settings of the engine's retraction tests, at
the default model's size). The radix cache is off, as on a decode node, so a recompute cannot reuse
cached pages of its own prompt.

Reported: wall and CPU time of the whole workload per mode (best of `--repeats`, modes interleaved;
one torch thread by default, so the CPU time is the work done even on a busy machine), the
retractions, restores, recomputes and prefill tokens of each, and the ratios `retract_offload_speedup`
= wall time off / on and `retract_offload_cpu_speedup` = CPU time off / on (higher is better). The two modes
must produce identical tokens (exit 1 if not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.report import write_report


def log(msg: str) -> None:
    print(f"[bench retract {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench retract", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="model directory, .gguf, or 'default' (SmolLM2-135M)")
    p.add_argument("--json", default=None, help="write the report to this file")
    p.add_argument("--requests", type=int, default=16, help="requests, all sent at once")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool in tokens (default: 30%% of what the requests need together)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size")
    p.add_argument("--offload-size", type=int, default=None,
                   help="--decode-offload-size of the 'on' run (default: the KV pool's size)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the CPU time then measures the work done, whatever "
                        "else runs)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode (interleaved; best counts)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    args = p.parse_args(argv)
    if args.requests < 2 or args.prompt_len < 1 or args.max_new_tokens < 2 or args.repeats < 1:
        p.error("need --requests >= 2, --prompt-len >= 1, --max-new-tokens >= 2, --repeats >= 1")
    return args


class Workload:
    """One runner (model and pools) shared by a scheduler per mode; each run starts on empty pools."""

    def __init__(self, a: argparse.Namespace, model_dir: str) -> None:
        from common.config import ServerArgs
        from common.runner import ModelRunner

        need = a.requests * (a.prompt_len + a.max_new_tokens)
        total = a.max_total_tokens or max(need * 3 // 10, a.prompt_len + a.max_new_tokens + 2 * a.page_size)
        self.common = dict(model=model_dir, page_size=a.page_size, max_total_tokens=total,
                           max_running_requests=a.requests, chunked_prefill_size=512, max_prefill_tokens=8192,
                           context_length=a.prompt_len + a.max_new_tokens + a.page_size,
                           disable_radix_cache=True, init_new_token_ratio=0.05, min_new_token_ratio=0.01)
        self.offload = {"off": 0, "on": a.offload_size if a.offload_size is not None else total}
        self.runner = ModelRunner(ServerArgs(**self.common), model_dir)
        self.model_dir = model_dir
        self.max_new = a.max_new_tokens
        g = torch.Generator().manual_seed(a.seed)
        vocab = self.runner.model_config.vocab_size
        self.prompts = [torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist()
                        for _ in range(a.requests)]
        self.total_tokens = total

    def run(self, mode: str, warmup: bool = False) -> tuple[float, float, dict, dict[str, list[int]]]:
        from common.config import ServerArgs
        from common.protocol import SamplingParams, TokenizedRequest
        from common.scheduler.scheduler import Scheduler

        args = ServerArgs(**self.common, decode_offload_size=self.offload[mode])
        args.validate()
        sent: list = []
        sched = Scheduler(args, self.model_dir, runner=self.runner, send_fn=sent.append)
        sp = SamplingParams(max_new_tokens=self.max_new, temperature=0, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.process_time()
        prompts = self.prompts[:2] if warmup else self.prompts
        if warmup:
            sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        sched.process_input_requests([TokenizedRequest(rid=f"r{i}", input_ids=p, sampling=sp)
                                      for i, p in enumerate(prompts)])
        sched.run_until_idle()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = sched.get_stats()
        tokens: dict[str, list[int]] = {}
        for msg in sent:
            for u in getattr(msg, "updates", []):
                tokens.setdefault(u.rid, []).extend(u.new_token_ids)
        if sched.allocator.available_size() != sched.allocator.capacity:
            raise RuntimeError(f"{mode}: KV pages leaked")
        keep = ("num_retractions", "num_retract_offloaded", "num_retract_restored", "num_retract_recomputed",
                "total_prefill_tokens", "forward_ct", "total_generated_tokens",
                "decode_offload_capacity_tokens", "decode_offload_evictions", "decode_offload_rejected")
        return elapsed, cpu, {k: stats[k] for k in keep}, tokens


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    from common.models.default_model import resolve_model_path

    model_dir = resolve_model_path(a.model)
    log(f"model {model_dir}")
    w = Workload(a, model_dir)
    log(f"{a.requests} requests x ({a.prompt_len} prompt + {a.max_new_tokens} new) tokens on a KV pool of "
        f"{w.total_tokens} tokens; offload on: {w.offload['on']} tokens")
    w.run("on", warmup=True)  # two short requests: first-touch of the pools and kernels; not timed
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    stats: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    for r in range(a.repeats):
        for mode in ("off", "on"):
            t, c, s, toks = w.run(mode)
            times[mode].append(t)
            cpus[mode].append(c)
            stats[mode], outputs[mode] = s, toks
            log(f"repeat {r + 1}/{a.repeats} {mode}: {t:.2f}s ({c:.2f}s CPU), {s['num_retractions']} "
                f"retractions, {s['num_retract_restored']} restored, {s['num_retract_recomputed']} "
                f"recomputed, {s['total_prefill_tokens']} prefill tokens")
    same = outputs["off"] == outputs["on"]
    if not same:
        log("ERROR: the tokens differ between offload off and on")
    best = {m: min(ts) for m, ts in times.items()}
    best_cpu = {m: min(cs) for m, cs in cpus.items()}
    figures = {
        "workload": {"requests": a.requests, "prompt_len": a.prompt_len, "max_new_tokens": a.max_new_tokens,
                     "kv_pool_tokens": w.total_tokens, "page_size": a.page_size,
                     "offload_tokens": w.offload["on"],
                     "radix_cache": False, "repeats": a.repeats, "model": model_dir,
                     "torch_threads": torch.get_num_threads()},
        "time_s": {m: {"best": round(best[m], 4), "median": round(statistics.median(ts), 4),
                       "all": [round(t, 4) for t in ts]} for m, ts in times.items()},
        "cpu_time_s": {m: {"best": round(best_cpu[m], 4), "all": [round(c, 4) for c in cs]}
                       for m, cs in cpus.items()},
        "stats": stats,
        "prefill_tokens_saved": stats["off"]["total_prefill_tokens"] - stats["on"]["total_prefill_tokens"],
        "tokens_identical": same,
    }
    write_report(a.json, "retract", figures, {"retract_offload_speedup": best["off"] / best["on"],
                                              "retract_offload_cpu_speedup": best_cpu["off"]
                                              / best_cpu["on"]})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
