"""`pdserve bench engine`: our engine vs HF transformers on the same model, in the same process.

Measured (fp32, CPU, greedy):

* decode tokens/s at batch 1 and 16: ours drives the real `ModelRunner` (prefill the prompts with
  one EXTEND forward, then `--decode-steps` DECODE steps; each step includes building the batch,
  allocating KV slots, the forward and the sampler). HF runs `generate(do_sample=False,
  max_new_tokens=N, min_new_tokens=N)` on a left-padded batch; the time of the same call with N=1
  (prefill + first token) is subtracted, so both sides count per-token decode only.
* the decode step through the real scheduler loop with overlap scheduling on and off, at batch 1
  and 16 (`bench/overlap.py`); ratio `overlap_b<B>` = step time off / on (higher is better), and
  `overlap_free_core_b<B>` the same at one torch thread fewer when the bench's take every core.
* prefill tokens/s for one `--prompt-len`-token prompt: ours one EXTEND forward; HF one forward
  with `logits_to_keep=1` (what HF's own `generate` does on prefill; ours also projects only the
  last position). Then the same prefill split by phase (`prefill_phases`: norms, the q/k/v
  and output projections, the rest of attention, the MLP, the rest; bench/prefill_phases.py),
  the median of `--repeats` forwards.
* the memory-bandwidth bound of decode: best-of measured memcpy (reported as bytes copied per
  second, and as traffic = 2x that) and a read-only pass (sum over a large buffer); a decode step must
  read every weight once (lm_head included; with tied embeddings the matrix counts once), so
  `bound step = weight bytes / best bandwidth`. Ratio `bandwidth_bound` = bound step / our b1 step.
* the compute bound of decode at batch 16: the step's fp32 FLOPs (2 per weight per token, plus
  attention over the average context) / the best measured fp32 matmul rate (a 1024^3 and 2048^3
  `torch.mm`, more than a 16-row matmul can reach), sampled right after each of our timed decode and
  prefill runs and once at the end, the best sample taken: the host's speed drifts, and a peak measured
  only at the end once put a prefill above its own bound (1.06). Ratio `compute_bound_b16` = bound step / our
  b16 step. HF's b16 step / the bound is the most any engine could gain over HF here.
* the roofline of that b16 step: the matmuls take at least the longer of their FLOPs at that rate and
  the weights they read at 16 rows (float32 panels above `native.block_rows()` rows) at the best
  bandwidth; the attention the longer of its FLOPs and the 16 requests' K and V over the average
  context at that bandwidth (they are read from DRAM every step: ~118 MB for SmolLM2 at the default
  contexts, more than the L3). Ratio `roofline_b16` = the sum / our b16 step. The compute bound above
  leaves the K and V traffic out; at 16 rows the float32 matmuls sit near the ridge, ~8 FLOP a byte.
  Attention reads the pool in runs of one page of one layer and head (4 KB for SmolLM2), scattered,
  which a host reads slower than one long buffer; the figures also give that rate (runs of that size
  in random order) and the roofline with the K and V at it (`step_page_runs_ms`).
* the compute bound of a `--prompt-len` prefill: every weight but the lm_head twice per prompt token,
  the lm_head once (only the last position's logits), causal attention (2 x layers x heads x
  head_dim x len^2), at the same matmul rate. Ratio `prefill_compute_bound` = bound / our prefill.
  `prefill_fma_bound`: the same FLOPs at the cores' FMA rate (`fma_peak_gflops`: vector FMAs from
  registers alone, `common/layers/fma_peak.c`, sampled after each timed prefill and at the end, the best
  kept), which no matmul reaches: a float32 prefill stays below 1,
  and the gap is the most it could still gain.
* n-gram speculative decoding through the scheduler loop with `--speculative-algorithm NGRAM` on and
  off (`bench/speculative.py`), on a repetitive workload (ARCHITECTURE.md passages given twice) and on chat
  questions: ratio `spec_ngram` = decode tokens/s on / off, repetitive, batch 1; `spec_ngram_b16`
  at 16; `spec_ngram_chat`, `spec_ngram_chat_b16` on chat; each with its accept length.
* EAGLE / MTP speculation with draft layers (`bench/draft_layers.py`) at both ends of the accept
  length, on the bench's model at full size: `spec_mtp_exact` (every draft accepted) and
  `spec_mtp_random` (random draft layers) = decode tokens/s on / off at batch 1, `_b16` at 16.

Every measurement is warmed up, repeated `--repeats` times interleaving ours and HF, and the best
(min time) is used for the ratios; medians are reported too. Ratios are ours / HF tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from bench import prefill_phases
from bench.host_peaks import fma_peak_gflops, matmul_peak_gflops, memory_bandwidth, prefill_work
from bench.report import write_report
from common.scheduler.speculative import DEFAULT_NUM_DRAFT_TOKENS

BATCHES = (1, 16)
# the speculation workload's prompts: an ARCHITECTURE.md passage of this many tokens, twice
SPEC_PASSAGE_TOKENS = 120


def log(msg: str) -> None:
    print(f"[bench engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="model directory, .gguf, or 'default' (SmolLM2-135M)")
    p.add_argument("--json", default=None, help="write the report to this file")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--decode-prompt-len", type=int, default=128, help="prompt tokens before decoding")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repeats of each measurement (this VM's speed drifts by up to 1.5x over "
                        "seconds)")
    p.add_argument("--skip-hf", action="store_true", help="measure only our engine (no ratios vs HF)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                   help="tokens per verify forward of the n-gram speculation measurement")
    p.add_argument("--speculative-num-steps", type=int, default=3,
                   help="draft steps per verify of the EAGLE / MTP measurement")
    args = p.parse_args(argv)
    if args.decode_steps < 2:
        p.error("--decode-steps must be >= 2")
    if args.prompt_len < 1 or args.decode_prompt_len < 1:
        p.error("prompt lengths must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------- ours
class OurEngine:
    """Drives `common.runner.ModelRunner` the way the scheduler does, minus the scheduling policy."""

    def __init__(self, model_dir: str, max_tokens_per_req: int, max_batch: int,
                 quantization: str | None = None) -> None:
        from common.config import ServerArgs
        from common.runner import ModelRunner

        page = 16
        per_req = -(-max_tokens_per_req // page) * page + page
        args = ServerArgs(model=model_dir, max_total_tokens=per_req * max_batch + 4 * page,
                          max_running_requests=max_batch, page_size=page,
                          context_length=max_tokens_per_req + page,
                          torchao_config=quantization if quantization == "int8wo" else "",
                          quantization=quantization if quantization == "w8a8_int8" else "")
        self.runner = ModelRunner(args, model_dir)
        gc.collect()
        gc.freeze()  # as the scheduler process does before its loop
        self.cfg = self.runner.model_config
        self.vocab = self.runner.vocab_size

    def _greedy(self, logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        from common.layers.sampling import SamplingBatchInfo
        from common.protocol import SamplingParams

        b = logits.shape[0]
        info = SamplingBatchInfo.build([SamplingParams(temperature=0.0)] * b, outputs, self.vocab, [None] * b,
                                       list(self.cfg.eos_token_ids))
        return self.runner.sample(logits, info).next_token_ids

    def _extend_batch(self, prompts: list[list[int]]):
        from common.forward_batch import ForwardBatch, ForwardMode

        r = self.runner
        rows, slots, lens = [], [], []
        for p in prompts:
            row = r.req_to_token_pool.alloc()
            s = r.allocator.alloc_extend(0, 0, len(p))
            r.req_to_token_pool.write(row, 0, s)
            rows.append(row)
            slots.append(s)
            lens.append(len(p))
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
            positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]),
            out_cache_loc=torch.cat(slots), req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=list(lens), extend_prefix_lens=[0] * len(lens), extend_seq_lens=list(lens),
            kv_pool=r.kv_pool, req_to_token=r.req_to_token_pool.req_to_token)
        return fb, rows, lens

    def _release(self, rows: list[int], lens: list[int]) -> None:
        r = self.runner
        for row, n in zip(rows, lens, strict=True):
            r.allocator.free_slots(r.req_to_token_pool.slots(row, 0, n))
            r.req_to_token_pool.free(row)

    def prefill(self, prompt: list[int]) -> float:
        """Seconds for one EXTEND forward (+ sampling) of one prompt."""
        fb, rows, lens = self._extend_batch([prompt])
        t0 = time.perf_counter()
        logits = self.runner.forward(fb)
        self._greedy(logits, [[]])
        dt = time.perf_counter() - t0
        self._release(rows, lens)
        return dt

    def generate(self, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
        """Prefill, then time `steps` decode steps. Returns (decode seconds, decode CPU seconds of this
        process, generated tokens)."""
        from common.forward_batch import ForwardBatch, ForwardMode

        r = self.runner
        fb, rows, lens = self._extend_batch(prompts)
        nxt = self._greedy(r.forward(fb), [[] for _ in prompts])
        outputs = [[t] for t in nxt.tolist()]
        row_t = torch.tensor(rows, dtype=torch.int64)
        last_slot = [int(r.req_to_token_pool.req_to_token[row, n - 1])
                     for row, n in zip(rows, lens, strict=True)]
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            slots = []
            for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
                s = r.allocator.alloc_extend(n, last_slot[i], 1)
                r.req_to_token_pool.write(row, n, s)
                last_slot[i] = int(s[0])
                slots.append(s)
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=nxt, positions=torch.tensor(lens, dtype=torch.int64),
                out_cache_loc=torch.cat(slots), req_pool_indices=row_t, seq_lens=[n + 1 for n in lens],
                extend_prefix_lens=list(lens), extend_seq_lens=[1] * len(lens), kv_pool=r.kv_pool,
                req_to_token=r.req_to_token_pool.req_to_token)
            nxt = self._greedy(r.forward(fb), outputs)
            lens = [n + 1 for n in lens]
            for out, t in zip(outputs, nxt.tolist(), strict=True):
                out.append(t)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        self._release(rows, lens)
        return dt, dc, outputs

    def weight_bytes(self, rows: int = 1) -> int:
        """Bytes of every weight a decode step of `rows` requests reads: the packed copies of the linear
        layers (int8 and their scales with `--torchao-config int8wo`; a checkpoint's blocks where the weights
        have them and the batch is small enough to read them, `common/layers/weight_blocks.py`), the other
        parameters, and the lm_head once (the embedding is read only at the batch's rows, so it is not
        counted unless it is the lm_head)."""
        from common.layers import native
        from common.layers.linear import Panels

        blocks = rows <= native.block_rows()

        def nbytes(t) -> int:
            if isinstance(t, Panels):
                if t.blocks is not None and blocks:
                    return nbytes(t.blocks.packed)
                return nbytes(t.weight) + nbytes(t.scale)
            return 0 if t is None else t.numel() * t.element_size()

        return sum(nbytes(t) for t in self._step_weights())

    def weight_count(self) -> int:
        """How many weights a decode step multiplies each token by (the same weights as `weight_bytes`,
        counted as numbers, whatever their storage; packed ones with their panels' zero padding)."""
        from common.layers.linear import Panels

        return sum(t.weight.numel() if isinstance(t, Panels) else t.numel() for t in self._step_weights())

    def _step_weights(self) -> list:
        model = self.runner.model
        emb, lm = model.model.embed_tokens.weight, model.lm_head_weight
        lm_packed = getattr(model, "lm_head_packed", None)
        out = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) in seen or p.device.type == "meta" \
                    or (p is emb and (lm is not emb or lm_packed is not None)):
                continue  # (a packed layer keeps a meta parameter for its shape: its packed copy is above)
            seen.add(id(p))
            out.append(p)
        return out + ([lm_packed] if lm_packed is not None else [])


# ---------------------------------------------------------------------------------------------- HF
class HFEngine:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        gc = self.model.generation_config
        eos = gc.eos_token_id
        self.pad = gc.pad_token_id if gc.pad_token_id is not None \
            else (eos[0] if isinstance(eos, list) else eos)

    def _inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, torch.Tensor]:
        """(seconds, CPU seconds of this process, generated tokens) of one `generate` call."""
        ids, mask = self._inputs(prompts)
        c0, t0 = time.process_time(), time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=self.pad,
                                  temperature=None, top_p=None, top_k=None)
        return time.perf_counter() - t0, time.process_time() - c0, out[:, ids.shape[1]:]

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt], dtype=torch.int64)
        t0 = time.perf_counter()
        self.model(input_ids=ids, logits_to_keep=1)
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- main
def _summary(times: list[float], work: float) -> dict:
    best, med = min(times), statistics.median(times)
    return {"best_s": best, "median_s": med, "tok_s_best": work / best, "tok_s_median": work / med,
            "runs_s": [round(t, 5) for t in times]}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # token ids away from the special ones at the start of the vocabulary
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    from common.models.default_model import resolve_model_path

    model_dir = resolve_model_path(args.model)
    n = args.decode_steps
    log(f"model {model_dir}, torch threads {torch.get_num_threads()}, decode steps {n}, "
        f"decode prompt {args.decode_prompt_len}, prefill prompt {args.prompt_len}")
    ours = OurEngine(model_dir,
                     max(args.prompt_len, args.decode_prompt_len + n, 2 * SPEC_PASSAGE_TOKENS + n) + 1,
                     max(BATCHES))
    log(f"ours loaded: {ours.cfg.name} ({ours.cfg.architecture}), {ours.weight_bytes() / 2**20:.1f} MiB of "
        "weights read per decode step")
    hf = None if args.skip_hf else HFEngine(model_dir)
    if hf is not None:
        log("HF transformers loaded")
    vocab = ours.vocab

    figures: dict = {"model": ours.cfg.name, "model_dir": model_dir, "decode_steps": n,
                     "decode_prompt_len": args.decode_prompt_len, "prompt_len": args.prompt_len,
                     "threads": torch.get_num_threads(), "repeats": args.repeats}

    # ---- warmup (both engines, every shape)
    log("warmup")
    for b in BATCHES:
        ps = _prompts(b, args.decode_prompt_len, vocab, seed=b)
        ours.generate(ps, 4)
        if hf is not None:
            hf.generate(ps, 4)
            hf.generate(ps, 1)
    pp = _prompts(1, args.prompt_len, vocab, seed=99)[0]
    ours.prefill(pp)
    if hf is not None:
        hf.prefill(pp)

    # ---- decode
    agreement = {}
    peaks: list[float] = []  # matmul peak samples, one after each of our timed decode and prefill runs
    for b in BATCHES:
        ps = _prompts(b, args.decode_prompt_len, vocab, seed=b)
        ours_t, hf_t, ours_c, hf_c = [], [], [], []
        for rep in range(args.repeats):
            dt, dc, toks = ours.generate(ps, n - 1)  # + the token of the prefill = n tokens, n-1 decode steps
            peaks.append(matmul_peak_gflops(repeats=2))  # the peak in the same minutes as the step it bounds
            ours_t.append(dt)
            ours_c.append(dc)
            msg = f"decode b{b} run {rep + 1}/{args.repeats}: ours {b * (n - 1) / dt:8.1f} tok/s"
            if hf is not None:
                t_n, c_n, out = hf.generate(ps, n)
                t_1, c_1, _ = hf.generate(ps, 1)
                if t_n > t_1 and c_n > c_1:
                    hf_t.append(t_n - t_1)
                    hf_c.append(c_n - c_1)
                    msg += f", HF {b * (n - 1) / hf_t[-1]:8.1f} tok/s"
                else:  # a busy machine can make the 1-token run the slower one: not a measurement
                    msg += ", HF run discarded (1-token generate took longer than the full one)"
                if rep == 0:
                    same = sum(int(a == bb) for o, r in zip(toks, out.tolist(), strict=True)
                               for a, bb in zip(o, r, strict=False))
                    agreement[f"b{b}"] = same / (b * n)
            log(msg)
        figures[f"ours_decode_b{b}"] = _summary(ours_t, b * (n - 1))
        figures[f"ours_decode_b{b}"]["step_ms_best"] = 1e3 * min(ours_t) / (n - 1)
        # CPU time of this process per step: less sensitive to other load on a shared machine
        figures[f"ours_decode_b{b}"]["cpu_step_ms_best"] = 1e3 * min(ours_c) / (n - 1)
        if hf is not None:
            if not hf_t:
                raise SystemExit(f"every HF decode b{b} run was discarded; rerun on a quieter machine "
                                 "or with more --repeats")
            figures[f"hf_decode_b{b}"] = _summary(hf_t, b * (n - 1))
            figures[f"hf_decode_b{b}"]["step_ms_best"] = 1e3 * min(hf_t) / (n - 1)
            figures[f"hf_decode_b{b}"]["cpu_step_ms_best"] = 1e3 * min(hf_c) / (n - 1)
    if agreement:
        figures["greedy_token_agreement_with_hf"] = agreement

    # ---- decode through the scheduler loop, overlap on and off
    from bench.overlap import measure as measure_overlap

    log("decode through the scheduler loop, overlap scheduling on and off")
    loop_figures, loop_ratios = measure_overlap(
        ours.runner, model_dir,
        {b: _prompts(b, args.decode_prompt_len, vocab, seed=b) for b in BATCHES}, n - 1, args.repeats, log)
    figures.update(loop_figures)

    # ---- n-gram speculative decoding, repetitive and chat workloads
    from bench.speculative import chat_prompts, repetitive_prompts
    from bench.speculative import measure as measure_spec

    log("n-gram speculative decoding through the scheduler loop, on and off")
    spec_prompts = {"repetitive": {b: repetitive_prompts(model_dir, b, SPEC_PASSAGE_TOKENS) for b in BATCHES},
                    "chat": {b: chat_prompts(model_dir, b) for b in BATCHES}}
    spec_figures, spec_ratios = measure_spec(ours.runner, model_dir, spec_prompts, n,
                                             args.speculative_num_draft_tokens, args.repeats, log)
    figures.update(spec_figures)

    # ---- EAGLE / MTP draft layers, at both ends of the accept length
    from bench.draft_layers import measure as measure_draft_layers

    log("EAGLE / MTP draft layers through the scheduler loop, on and off")
    draft_figures, draft_ratios = measure_draft_layers(
        ours.runner.args, model_dir,
        {b: _prompts(b, args.decode_prompt_len, vocab, seed=b) for b in BATCHES}, n,
        args.speculative_num_steps, args.repeats, log)
    figures.update(draft_figures)

    # ---- prefill
    ours_t, hf_t = [], []
    fmas: list[float] = []  # FMA rate samples, one after each of our timed prefills and one at the end
    for rep in range(args.repeats):
        ours_t.append(ours.prefill(pp))
        peaks.append(matmul_peak_gflops(repeats=2))
        fmas.append(fma_peak_gflops(repeats=2) or 0.0)
        msg = (f"prefill {args.prompt_len} run {rep + 1}/{args.repeats}: "
               f"ours {args.prompt_len / ours_t[-1]:8.1f} tok/s")
        if hf is not None:
            hf_t.append(hf.prefill(pp))
            msg += f", HF {args.prompt_len / hf_t[-1]:8.1f} tok/s"
        log(msg)
    figures["ours_prefill"] = _summary(ours_t, args.prompt_len)
    if hf is not None:
        figures["hf_prefill"] = _summary(hf_t, args.prompt_len)
    figures["prefill_phases"] = prefill_phases.measure(ours, pp, args.repeats)
    log(prefill_phases.describe(figures["prefill_phases"]))

    # ---- bandwidth bound
    log("memory bandwidth")
    pool = ours.runner.kv_pool
    bw = memory_bandwidth(pool.head_bytes)
    wbytes = ours.weight_bytes()
    best_bw = max(bw["memcpy_traffic_gbps"], bw["read_gbps"])
    bound_ms = wbytes / (best_bw * 1e9) * 1e3
    our_step_ms = figures["ours_decode_b1"]["step_ms_best"]
    figures["bandwidth"] = {**bw, "bandwidth_used_gbps": best_bw, "weight_bytes_per_step": wbytes,
                            "bound_step_ms": bound_ms, "ours_b1_step_ms": our_step_ms,
                            "ours_b1_effective_gbps": wbytes / (our_step_ms / 1e3) / 1e9}

    log("matmul peak")
    peaks.append(matmul_peak_gflops())
    peak = max(peaks)
    log(f"matmul peak {peak:.0f} GFLOPS, the best of {len(peaks)} samples ({min(peaks):.0f}-{peak:.0f})")
    fmas.append(fma_peak_gflops() or 0.0)
    fma = max(fmas) or None  # None without the native kernels
    if fma is not None:
        log(f"FMA peak {fma:.0f} GFLOPS, the best of {len(fmas)} samples: the matmul peak is "
            f"{peak / fma:.2f} of it")
    cfg = ours.cfg
    ctx = args.decode_prompt_len + n / 2
    weights = ours.weight_count()  # not bytes / 4: small matmuls may read 4- or 8-bit blocks
    flops_tok = 2 * weights + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx
    cbound_ms = 16 * flops_tok / (peak * 1e9) * 1e3
    prefill_flops = sum(prefill_work(cfg, weights, args.prompt_len))
    pbound_s = prefill_flops / (peak * 1e9)
    # the roofline of a b16 step: the matmuls and the attention each take at least the longer of their FLOPs
    # at the matmul peak and their bytes (weights; the requests' K and V) at the best bandwidth
    attn_flops = 16 * (flops_tok - 2 * weights)
    kv_bytes = 16 * ctx * len(pool.layer_ids) * 2 * pool.kv_heads * pool.head_dim * pool.data.element_size()
    w16_bytes = ours.weight_bytes(16)
    parts = {"matmuls": (16 * 2 * weights / (peak * 1e9), w16_bytes / (best_bw * 1e9)),
             "attention": (attn_flops / (peak * 1e9), kv_bytes / (best_bw * 1e9))}
    roof_ms = sum(max(v) for v in parts.values()) * 1e3
    # the same with the K and V at the rate this host reads the pool's scattered page runs
    run_gbps = bw["page_run_read_gbps"]
    attn_runs_ms = kv_bytes / (run_gbps * 1e9) * 1e3
    figures["roofline_b16"] = {"weight_bytes": w16_bytes, "kv_bytes": kv_bytes,
                               **{f"{k}_compute_ms": v[0] * 1e3 for k, v in parts.items()},
                               **{f"{k}_memory_ms": v[1] * 1e3 for k, v in parts.items()}, "step_ms": roof_ms,
                               "page_run_bytes": pool.head_bytes, "page_run_read_gbps": run_gbps,
                               "attention_page_runs_ms": attn_runs_ms,
                               "step_page_runs_ms": max(parts["matmuls"]) * 1e3
                               + max(parts["attention"][0] * 1e3, attn_runs_ms)}
    figures["compute"] = {"matmul_peak_gflops": peak, "matmul_peak_samples": peaks,
                          "flops_per_token": flops_tok, "bound_b16_step_ms": cbound_ms,
                          "ours_b16_step_ms": figures["ours_decode_b16"]["step_ms_best"],
                          "prefill_flops": prefill_flops, "bound_prefill_s": pbound_s,
                          "ours_prefill_s": figures["ours_prefill"]["best_s"], "fma_peak_gflops": fma,
                          "fma_peak_samples": fmas}
    if hf is not None:
        figures["compute"]["hf_b16_step_over_bound"] = figures["hf_decode_b16"]["step_ms_best"] / cbound_ms

    ratios = {"bandwidth_bound": bound_ms / our_step_ms,
              "compute_bound_b16": cbound_ms / figures["ours_decode_b16"]["step_ms_best"],
              "roofline_b16": roof_ms / figures["ours_decode_b16"]["step_ms_best"],
              "prefill_compute_bound": pbound_s / figures["ours_prefill"]["best_s"],
              **({"prefill_fma_bound": prefill_flops / (fma * 1e9) / figures["ours_prefill"]["best_s"]}
                 if fma else {}),
              **loop_ratios, **spec_ratios, **draft_ratios}
    if hf is not None:
        ratios = {"decode_b1": figures["ours_decode_b1"]["tok_s_best"]
                  / figures["hf_decode_b1"]["tok_s_best"],
                  "decode_b16": figures["ours_decode_b16"]["tok_s_best"]
                  / figures["hf_decode_b16"]["tok_s_best"],
                  "prefill_512": figures["ours_prefill"]["tok_s_best"] / figures["hf_prefill"]["tok_s_best"],
                  **ratios}
    print_table(figures, ratios, hf is not None)
    write_report(args.json, "engine", figures, ratios)
    return 0


def print_table(figures: dict, ratios: dict, with_hf: bool) -> None:
    rows = [("decode b1 (tok/s)", "decode_b1"), ("decode b16 (tok/s)", "decode_b16"),
            (f"prefill {figures['prompt_len']} (tok/s)", "prefill")]
    print(f"\nengine bench: {figures['model']}, {figures['threads']} threads, best of {figures['repeats']} "
          f"(median in brackets)")
    print(f"  {'':24s} {'pdserve':>22s} {'HF transformers':>22s} {'ratio':>7s}")
    for label, key in rows:
        o = figures[f"ours_{key}"]
        ours_s = f"{o['tok_s_best']:9.1f} ({o['tok_s_median']:9.1f})"
        if with_hf:
            h = figures[f"hf_{key}"]
            hf_s = f"{h['tok_s_best']:9.1f} ({h['tok_s_median']:9.1f})"
            r = ratios["prefill_512" if key == "prefill" else key]
            print(f"  {label:24s} {ours_s:>22s} {hf_s:>22s} {r:7.2f}")
        else:
            print(f"  {label:24s} {ours_s:>22s}")
    for bsz in BATCHES:
        o = figures[f"ours_decode_b{bsz}"]
        line = (f"  decode b{bsz} ms/step (best): ours {o['step_ms_best']:.2f} wall, "
                f"{o['cpu_step_ms_best']:.2f} CPU")
        if with_hf:
            h = figures[f"hf_decode_b{bsz}"]
            line += f"; HF {h['step_ms_best']:.2f} wall, {h['cpu_step_ms_best']:.2f} CPU"
        print(line)
    for key, o in figures.items():
        if key.startswith("loop_decode_"):
            r = ratios["overlap_" + key.removeprefix("loop_decode_")]
            print(f"  scheduler loop {key.removeprefix('loop_decode_')} at {o['torch_threads']} threads, "
                  f"ms/step (best): {o['step_ms_overlap']:.2f} overlapped, {o['step_ms_sequential']:.2f} in "
                  f"sequence (x{r:.2f}); the loop's own work {o['loop_ms_sequential']:.2f} of it (overlap "
                  f"could gain x{o['overlap_ceiling']:.3f} at most)")
    for tag, label in (("", "repetitive"), ("_chat", "chat")):
        for bsz in BATCHES:
            o = figures[f"spec_ngram{tag}_b{bsz}"]
            r = ratios[f"spec_ngram{tag}" if bsz == 1 else f"spec_ngram{tag}_b{bsz}"]
            print(f"  n-gram speculation {label} b{bsz} ({o['draft_tokens']} tokens per verify): "
                  f"{o['tok_s_plain']:.1f} -> {o['tok_s_spec']:.1f} tok/s (x{r:.2f}), "
                  f"accept length {o['spec_accept_length']:.2f}")
    for variant in ("exact", "random"):
        for bsz in BATCHES:
            o = figures[f"spec_mtp_{variant}_b{bsz}"]
            r = ratios[f"spec_mtp_{variant}" + ("" if bsz == 1 else f"_b{bsz}")]
            print(f"  MTP draft layers ({variant}) b{bsz} ({o['num_steps']} steps): {o['tok_s_plain']:.1f} "
                  f"-> {o['tok_s_spec']:.1f} tok/s (x{r:.2f}), accept length {o['spec_accept_length']:.2f}")
    b = figures["bandwidth"]
    print(f"  memory: memcpy {b['memcpy_gbps']:.1f} GB/s copied ({b['memcpy_traffic_gbps']:.1f} GB/s "
          f"traffic), read {b['read_gbps']:.1f} GB/s; weights {b['weight_bytes_per_step'] / 2**20:.1f} "
          f"MiB/step -> bound {b['bound_step_ms']:.2f} ms/step; ours b1 {b['ours_b1_step_ms']:.2f} ms/step "
          f"({b['ours_b1_effective_gbps']:.1f} GB/s effective)")
    c = figures["compute"]
    line = (f"  compute: matmul peak {c['matmul_peak_gflops']:.0f} GFLOPS; {c['flops_per_token'] / 1e6:.0f} "
            f"MFLOP/token -> b16 bound {c['bound_b16_step_ms']:.2f} ms/step; ours b16 "
            f"{c['ours_b16_step_ms']:.2f} ms/step; prefill bound {c['bound_prefill_s']:.3f} s, ours "
            f"{c['ours_prefill_s']:.3f} s")
    if "hf_b16_step_over_bound" in c:
        line += f"; HF b16 step / bound = {c['hf_b16_step_over_bound']:.2f} (the most any engine could gain)"
    print(line)
    r = figures["roofline_b16"]
    print(f"  b16 roofline {r['step_ms']:.2f} ms/step: matmuls {r['matmuls_compute_ms']:.2f} ms of FLOPs, "
          f"{r['matmuls_memory_ms']:.2f} ms of weights ({r['weight_bytes'] / 2**20:.0f} MiB); attention "
          f"{r['attention_compute_ms']:.2f} ms of FLOPs, {r['attention_memory_ms']:.2f} ms of K and V "
          f"({r['kv_bytes'] / 2**20:.0f} MiB); each part takes the longer")
    print(f"  the K and V at the pool's page-run rate ({r['page_run_bytes']} B runs in random order: "
          f"{r['page_run_read_gbps']:.1f} GB/s): attention {r['attention_page_runs_ms']:.2f} ms, "
          f"the roofline {r['step_page_runs_ms']:.2f} ms/step")
    if "greedy_token_agreement_with_hf" in figures:
        agree = ", ".join(f"{k} {v:.0%}" for k, v in figures["greedy_token_agreement_with_hf"].items())
        print(f"  greedy tokens equal to HF's: {agree}")


if __name__ == "__main__":
    sys.exit(main())
