"""`pdserve bench quant`: what int8 weights (`--torchao-config int8wo`) and int8 weights with int8
activations (`--quantization w8a8_int8`) cost in quality and buy in speed, against float32 on the same
model in the same run.

* quality: perplexity of a fixed text (this project's ARCHITECTURE.md, the first `--ppl-tokens` tokens, in
  windows of `--ppl-window` tokens scored in one prefill each), and greedy agreement: of `--prompts`
  random prompts, the fraction of the `--greedy-tokens` greedy tokens int8 generates that equal
  float32's, position by position until the first difference (`greedy_agreement`), and how many
  prompts agree all the way (`greedy_identical`);
* speed: the decode step at batch 1 and 16 and a 512-token prefill, as `pdserve bench engine` drives
  the runner, best of `--repeats` rounds that time both in turn.

Ratios (higher is better), for int8wo (`int8_*`) and w8a8_int8 (`w8a8_*`): `*_ppl` = float32
perplexity / the scheme's (the issue's bar: within 2 %, i.e. >= 0.98), `*_greedy_agreement`,
`*_decode_b1` and `*_decode_b16` = float32 step time / the scheme's, `*_prefill_512` = float32 prefill
time / the scheme's. Prefill against the compute bound: `float32_prefill_compute_bound` = (the prefill's
operations at the best measured float32 matmul rate, a 2048^3 `torch.mm`) / float32's prefill time;
`w8a8_prefill_compute_bound` the same for w8a8, its projections at the best measured int8 rate (a
2048^3 `torch._int_mm`, oneDNN's, and this project's w8a8 GEMM on the same shape; AMX where the CPU
has it) and the lm_head and attention, which stay float32, at the float32 rate. The host's speed
drifts, so the float32 and w8a8 rates are sampled after every round as well as at the end, and the best
sample is the bound's (as in `pdserve bench engine`); `torch._int_mm`, which can take seconds a call
where the CPU has no int8 matrix unit, is timed at the end only.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

import torch

from bench.engine import OurEngine, _prompts
from bench.host_peaks import matmul_peak_gflops, prefill_work
from bench.report import HelpFormatter, write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = {"int8wo": "int8", "w8a8_int8": "w8a8"}  # each scheme measured, and its ratios' prefix
PREFILL = 512  # tokens of the timed prefill


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench quant", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--model", default="default", help="model directory or 'default' (SmolLM2-135M)")
    a("--text", default=os.path.join(ROOT, "ARCHITECTURE.md"),
      help="the fixed text perplexity is measured on")
    a("--ppl-tokens", type=int, default=2048, help="tokens of the text scored")
    a("--ppl-window", type=int, default=512, help="tokens per scored window (one prefill each)")
    a("--prompts", type=int, default=16, help="random prompts for greedy agreement")
    a("--greedy-tokens", type=int, default=32, help="greedy tokens per prompt")
    a("--decode-steps", type=int, default=32, help="decode steps timed per run")
    a("--repeats", type=int, default=3, help="timed runs per figure (best is kept)")
    a("--peak-size", type=int, default=2048,
      help="n of the n^3 matmuls that measure the float32 and int8 peaks")
    a("--threads", type=int, default=None, help="torch threads (default: every core this process may use)")
    a("--json", default=None, help="write the report here")
    return p


def perplexity(eng: OurEngine, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of `ids[1:]`, each window scored from its own start."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        fb, rows, lens = eng._extend_batch([chunk[:-1]])
        fb.logits_indices = torch.arange(len(chunk) - 1)
        logp = torch.log_softmax(eng.runner.forward(fb).double(), dim=-1)
        eng._release(rows, lens)
        target = torch.tensor(chunk[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(tokens equal up to each prompt's first difference / all tokens, prompts equal throughout)."""
    same = 0
    for a, b in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same += n
    return same / sum(len(a) for a in ref), sum(a == b for a, b in zip(ref, got, strict=True))


def quality(eng: OurEngine, label: str, ns, text_ids, prompts) -> dict:
    fig = {"weight_mib": eng.weight_bytes() / 2**20, "perplexity": perplexity(eng, text_ids, ns.ppl_window)}
    log(f"{label}: {fig['weight_mib']:.1f} MiB of weights per decode step, perplexity "
        f"{fig['perplexity']:.4f}")
    _, _, fig["greedy"] = eng.generate(prompts, ns.greedy_tokens - 1)
    return fig


def speed(engines: dict[str, OurEngine], ns, peaks: dict[str, list[float]]) -> dict[str, dict]:
    """Best of `repeats` rounds, each timing every engine in turn (this VM's speed drifts: interleaving
    puts both sides in the same moments). After each round the float32 and w8a8 matmul rates are sampled
    into `peaks`."""
    vocab = next(iter(engines.values())).vocab
    batches = {b: _prompts(b, 64, vocab, seed=b) for b in (1, 16)}
    pp = _prompts(1, PREFILL, vocab, seed=99)[0]
    for eng in engines.values():  # warm every shape
        for ps in batches.values():
            eng.generate(ps, 2)
        eng.prefill(pp)
    times: dict[str, dict[str, list[float]]] = {label: {} for label in engines}
    for rep in range(ns.repeats):
        for label, eng in engines.items():
            t = times[label]
            for b, ps in batches.items():
                t.setdefault(f"decode_b{b}_ms",
                             []).append(1e3 * eng.generate(ps, ns.decode_steps)[0] / ns.decode_steps)
            t.setdefault("prefill_512_s", []).append(eng.prefill(pp))
            log(f"round {rep + 1}/{ns.repeats} {label}: "
                + ", ".join(f"{k} {v[-1]:.3f}" for k, v in t.items()))
        sample_peaks(peaks, ns.peak_size, repeats=2)
    return {label: {k: min(v) for k, v in t.items()} for label, t in times.items()}


def int8_peak_gops(n: int, repeats: int = 5,
                   names: tuple[str, ...] = ("w8a8_gemm", "torch_int_mm")) -> dict[str, float]:
    """Best int8 matmul rates on an n^3 product (2 operations per multiply-add) of `names`: torch's
    `_int_mm` (oneDNN) where this torch has it on CPU, and this project's w8a8 GEMM."""
    from common.layers.linear import linear, pack_weight

    x, w = torch.randn(n, n), torch.randn(n, n)
    packed = pack_weight(w, quantization="w8a8_int8")
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    calls = {"w8a8_gemm": lambda: linear(x, w, packed), "torch_int_mm": lambda: torch._int_mm(a, a)}
    best = {}
    for name in names:
        call = calls[name]
        try:
            call()
        except RuntimeError:  # no int8 matmul for this CPU build of torch
            continue
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        best[name] = 2 * n ** 3 / min(times) / 1e9
    return best


def prefill_ops(eng: OurEngine) -> tuple[float, float]:
    """The 512-token prefill's (projections', the rest's) operations. Weights are counted as numbers, not
    as bytes / 4: a model whose weights are a checkpoint's 4- or 8-bit blocks reads fewer bytes a decode
    step for the same multiplications."""
    return prefill_work(eng.cfg, eng.weight_count(), PREFILL)


def sample_peaks(peaks: dict[str, list[float]], n: int, repeats: int) -> None:
    """One sample each of the float32 (`torch.mm`) and w8a8 GEMM rates on n^3, appended to `peaks`."""
    peaks.setdefault("float32", []).append(matmul_peak_gflops(repeats=repeats, sizes=(n,)))
    for name, rate in int8_peak_gops(n, repeats, names=("w8a8_gemm",)).items():
        peaks.setdefault(name, []).append(rate)


def compute_bounds(engines: dict[str, OurEngine], runs: dict[str, dict], n: int,
                   peaks: dict[str, list[float]]) -> tuple[dict, dict]:
    """(figures, ratios) of each prefill against the compute bound (module docstring), rates on n^3: the
    best of `peaks` (sampled through the run) and of one more sample of each now."""
    sample_peaks(peaks, n, repeats=5)
    fp32 = max(peaks["float32"])
    int8 = {name: max(samples) for name, samples in peaks.items() if name != "float32"}
    int8.update(int8_peak_gops(n, names=("torch_int_mm",)))
    proj, rest = prefill_ops(engines["float32"])
    bound_f32 = (proj + rest) / (fp32 * 1e9)
    bound_w8a8 = proj / (max(int8.values()) * 1e9) + rest / (fp32 * 1e9)
    figures = {"float32_matmul_peak_gflops": fp32, "int8_matmul_peak_gops": int8, "peak_samples": peaks,
               "prefill_512_ops": proj + rest,
               "float32_bound_prefill_512_s": bound_f32, "w8a8_bound_prefill_512_s": bound_w8a8}
    ratios = {"float32_prefill_compute_bound": bound_f32 / runs["float32"]["prefill_512_s"],
              "w8a8_prefill_compute_bound": bound_w8a8 / runs["w8a8_int8"]["prefill_512_s"]}
    log(f"compute bound: float32 {fp32:.0f} GFLOPS (samples {min(peaks['float32']):.0f}-{fp32:.0f}), int8 "
        + ", ".join(f"{k} {v:.0f}" for k, v in int8.items())
        + f" GOPS; 512-token prefill bound {bound_f32:.3f} s float32, {bound_w8a8:.3f} s w8a8")
    return figures, ratios


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if min(ns.ppl_tokens, ns.ppl_window, ns.prompts, ns.greedy_tokens, ns.decode_steps, ns.repeats,
           ns.peak_size) < 1:
        print("every count must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(ns.threads or len(os.sched_getaffinity(0)))
    from transformers import AutoTokenizer

    from common.models.default_model import resolve_model_path

    model_dir = resolve_model_path(ns.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(ns.text, encoding="utf-8") as f:
        text_ids = tok(f.read())["input_ids"][:ns.ppl_tokens]
    if len(text_ids) < 2:
        print(f"{ns.text}: fewer than 2 tokens", file=sys.stderr)
        return 2
    rng = random.Random(0)
    prompts = [[rng.randrange(tok.vocab_size) for _ in range(32)] for _ in range(ns.prompts)]
    size = max(ns.ppl_window + 1, 512, 64 + ns.greedy_tokens + ns.decode_steps) + 1
    engines = {(q or "float32"): OurEngine(model_dir, size, 16, quantization=q) for q in (None, *SCHEMES)}
    runs = {label: quality(eng, label, ns, text_ids, prompts) for label, eng in engines.items()}
    peaks: dict[str, list[float]] = {}
    for label, fig in speed(engines, ns, peaks).items():
        runs[label].update(fig)
    ref = runs["float32"]
    greedy = ref.pop("greedy")
    ratios, identical = {}, {}
    for scheme, key in SCHEMES.items():
        q8 = runs[scheme]
        agree, identical[scheme] = agreement(greedy, q8.pop("greedy"))
        ratios.update({f"{key}_ppl": ref["perplexity"] / q8["perplexity"], f"{key}_greedy_agreement": agree,
                       f"{key}_decode_b1": ref["decode_b1_ms"] / q8["decode_b1_ms"],
                       f"{key}_decode_b16": ref["decode_b16_ms"] / q8["decode_b16_ms"],
                       f"{key}_prefill_512": ref["prefill_512_s"] / q8["prefill_512_s"]})
        log(f"{scheme}: perplexity {q8['perplexity']:.4f} (float32 {ref['perplexity']:.4f}); greedy "
            f"agreement {agree:.3f}, {identical[scheme]}/{ns.prompts} prompts identical")
    bound_figures, bound_ratios = compute_bounds(engines, runs, ns.peak_size, peaks)
    ratios.update(bound_ratios)
    figures = {"model_dir": model_dir, "text": os.path.relpath(ns.text, ROOT), "ppl_tokens": len(text_ids),
               "compute": bound_figures,
               "threads": torch.get_num_threads(),
               "greedy_identical": {s: f"{n}/{ns.prompts}" for s, n in identical.items()},
               "config": {**vars(ns), "argv": argv if argv is not None else sys.argv[1:]}, **runs}
    write_report(ns.json, "quant", figures, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
