"""`pdserve bench moe`: the mixture-of-experts block against two references in one run, and EPLB's effect on
the step time of two expert-parallel ranks under a skewed expert load.

**Layer** (one process, `--threads` torch threads): pdserve's `SparseMoE` (routing and the experts of
`common/layers/moe.py`, on the kernel `run_experts` picks), a per-expert loop in torch (for every expert: the
tokens that picked it, its two matmuls, the weighted rows added back) and transformers'
`Qwen3MoeSparseMoeBlock`, all on the same weights, timed in alternation at each token count of `--tokens`.
transformers has three experts implementations (`eager`, `batched_mm`, `grouped_mm`) whose speeds differ by
orders of magnitude; a probe call of each picks the fastest at that token count, which is then timed. Ratios:
`loop_t{T}` = the loop's median / ours and `transformers_t{T}` = transformers' / ours (higher is better).
Figures: each side's milliseconds, the probe's, and the largest difference of each output from ours.

**EPLB** (two gloo processes, one thread each, EP 2): `--layers` sparse blocks whose router sends
`--hot-share` of the pairs to the experts of EP rank 0. Without EPLB and then with it (`--spare-per-rank`
spare slots, a rebalance at the last of three warm-up forwards), batches of each of `--eplb-tokens` tokens
run through the stack, each step timed. Ratio `eplb_step_t{T}` = the step time without / with EPLB; figures:
both step times and the rank-load imbalance (max / mean pairs) before and after. Copies split an expert's
pairs, not its weights: where a batch gives each expert few pairs the step is bound by reading weights, which
a copy reads again, and only batches with many pairs per expert gain.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import socket
import sys
import time

import torch
import torch.nn.functional as F

from bench.kernels import _alternate
from bench.report import HelpFormatter, write_report
from common.layers.activation import silu_and_mul
from common.layers.moe import RoutingRule, SparseMoE

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")  # transformers' experts implementations


def log(msg: str) -> None:
    print(f"[bench moe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench moe", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size")
    p.add_argument("--experts", type=int, default=64, help="experts per block")
    p.add_argument("--top-k", type=int, default=8, help="experts a token picks")
    p.add_argument("--inter", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--tokens", default="1,8,32,256", help="token counts (batch rows) the layer runs on")
    p.add_argument("--calls", type=int, default=20, help="timed calls per side and token count")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the layer part (default: all)")
    p.add_argument("--layers", type=int, default=2, help="sparse blocks in the EPLB part's stack")
    p.add_argument("--spare-per-rank", type=int, default=None,
                   help="EPLB's spare expert slots on each EP rank (default: a quarter of the experts)")
    p.add_argument("--eplb-tokens", default="64,1024", help="token counts of the EPLB part's batches")
    p.add_argument("--eplb-calls", type=int, default=10, help="timed steps per EPLB setting and token count")
    p.add_argument("--hot-share", type=float, default=0.8,
                   help="share of the pairs routed to rank 0's experts")
    p.add_argument("--skip-eplb", action="store_true", help="measure the layer only")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def expert_loop(x: torch.Tensor, block: SparseMoE) -> torch.Tensor:
    """The reference: every expert in turn on the tokens that picked it."""
    weights, ids = block.select(x)
    w13, w2 = block.experts.w13, block.experts.w2
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, choice = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = F.linear(silu_and_mul(F.linear(x[tok], w13[e])), w2[e])
            out.index_add_(0, tok, y * weights[tok, choice].unsqueeze(1))
    return out


def transformers_block(block: SparseMoE, args, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                         moe_intermediate_size=args.inter, norm_topk_prob=True)
    cfg._experts_implementation = implementation
    ref = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        ref.gate.weight.copy_(block.gate.weight)
        ref.experts.gate_up_proj.copy_(block.experts.w13)
        ref.experts.down_proj.copy_(block.experts.w2)
    return ref


def make_block(args, seed: int = 0) -> SparseMoE:
    g = torch.Generator().manual_seed(seed)
    block = SparseMoE(args.experts, args.hidden, args.inter, RoutingRule(top_k=args.top_k, renormalize=True))
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(args.experts, args.hidden, generator=g) * 0.05)
        block.experts.w13.copy_(torch.randn(block.experts.w13.shape, generator=g) * 0.03)
        block.experts.w2.copy_(torch.randn(block.experts.w2.shape, generator=g) * 0.03)
    return block.eval()


def _median(fn, calls: int) -> float:
    return _alternate(calls, [fn])[0]


@torch.no_grad()
def layer_part(args) -> tuple[dict, dict]:
    block = make_block(args)
    refs = {name: transformers_block(block, args, name) for name in IMPLEMENTATIONS}
    figures, ratios = {}, {}
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t))
        ours = block(x)
        # transformers' implementations differ by orders of magnitude (batched_mm gathers each pair's expert
        # weights): one warm-up and one timed call each picks the one that goes into the alternation
        probe = {n: _median(functools.partial(r, x.unsqueeze(0)), 1) for n, r in refs.items()}
        best = min(probe, key=probe.get)
        sides = {"ours": functools.partial(block, x), "loop": functools.partial(expert_loop, x, block),
                 "transformers": functools.partial(refs[best], x.unsqueeze(0))}
        diffs = {name: (fn().reshape(t, -1) - ours).abs().max().item() for name, fn in sides.items()}
        medians = dict(zip(sides, _alternate(args.calls, list(sides.values())), strict=True))
        ratios[f"loop_t{t}"] = medians["loop"] / medians["ours"]
        ratios[f"transformers_t{t}"] = medians["transformers"] / medians["ours"]
        figures[f"layer_t{t}"] = {**{f"{n}_ms": round(v * 1e3, 4) for n, v in medians.items()},
                                  "transformers_implementation": best,
                                  "transformers_probe_ms": {n: round(v * 1e3, 3) for n, v in probe.items()},
                                  "max_abs_diff": {n: float(f"{d:.3g}") for n, d in diffs.items()
                                                   if n != "ours"}}
        log(f"{t:4d} tokens: ours {medians['ours'] * 1e3:8.3f} ms, loop {medians['loop'] * 1e3:8.3f} ms, "
            f"transformers ({best}) {medians['transformers'] * 1e3:8.3f} ms")
    return figures, ratios


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skewed_stack(args, ep_rank: int, spare: int) -> list[SparseMoE]:
    """EP rank `ep_rank`'s half of `--layers` blocks (the same model on both ranks), each router biased so
    that about `--hot-share` of the pairs go to rank 0's experts; with `spare` > 0 EPLB rebalances at the
    third forward."""
    from common.distributed import get_tp_group
    from common.layers.eplb import Eplb

    x, half, layers = skewed_input(args, max(_eplb_tokens(args))), args.experts // 2, []
    for layer in range(args.layers):
        full = make_block(args, seed=layer)
        block = SparseMoE(args.experts, args.hidden, args.inter, full.rule, tp_rank=ep_rank, tp_size=2,
                          tp_group=get_tp_group(), ep_size=2, eplb=Eplb(3, spare, layer) if spare else None)
        with torch.no_grad():
            block.gate.weight.copy_(full.gate.weight)
            for w, src in ((block.experts.w13, full.experts.w13), (block.experts.w2, full.experts.w2)):
                w.data[:half].copy_(src[ep_rank * half:(ep_rank + 1) * half])
        del full
        _bias_router(block, x, half, args.hot_share)
        layers.append(block.eval())
    return layers


def skewed_input(args, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(7))


def _eplb_tokens(args) -> list[int]:
    return [int(v) for v in args.eplb_tokens.split(",")]


@torch.no_grad()
def _bias_router(block: SparseMoE, x: torch.Tensor, half: int, share: float) -> None:
    """Lean the router rows of the first `half` experts towards the tokens' mean direction, bisecting on the
    measured share of pairs until about `share` go to them."""
    base = block.gate.weight.clone()
    direction = x.mean(0) / x.mean(0).norm()
    lo, hi = 0.0, 1.0
    for _ in range(16):
        mid = (lo + hi) / 2
        block.gate.weight.copy_(base)
        block.gate.weight[:half] += mid * direction
        _, ids = block.select(x)
        lo, hi = (mid, hi) if (ids < half).float().mean().item() < share else (lo, mid)


def _step(stack: list[SparseMoE], x: torch.Tensor) -> None:
    for block in stack:
        block(x)


@torch.no_grad()
def _eplb_rank(rank: int, init: str, args, queue) -> None:
    try:
        torch.set_num_threads(1)
        from common.distributed import destroy_distributed, init_distributed
        from common.layers.eplb import imbalance

        init_distributed(rank, 2, init)
        result = {}
        for mode, spare in (("off", 0), ("on", args.spare_per_rank or args.experts // 4)):
            stack = skewed_stack(args, rank, spare)
            x = skewed_input(args, max(_eplb_tokens(args)))
            for _ in range(3):  # warm-up; with EPLB the third forward rebalances every block
                _step(stack, x)
            for block in stack:
                block.eplb = None  # the placement stays as the rebalance left it
            imbalance_now = max(imbalance(b.load.tolist(), b.experts.placement.replicas, 2) for b in stack)
            share = sum(b.load[:args.experts // 2].sum().item() for b in stack) / sum(
                b.load.sum().item() for b in stack)
            for t in _eplb_tokens(args):
                x = skewed_input(args, t)
                times = []
                for _ in range(args.eplb_calls):
                    start = time.perf_counter()
                    _step(stack, x)
                    times.append(time.perf_counter() - start)
                result[(mode, t)] = {"step_ms": sorted(times)[len(times) // 2] * 1e3, "spare_per_rank": spare,
                                     "imbalance": imbalance_now, "hot_share": share}
            del stack
        queue.put((rank, result, None))
        destroy_distributed()
    except BaseException as e:
        import traceback

        queue.put((rank, None, f"{e!r}\n{traceback.format_exc()}"))


def eplb_part(args) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_eplb_rank, args=(r, init, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, result, err = queue.get(timeout=1800)
            if err is not None:
                raise SystemExit(f"bench moe: EPLB rank {rank} failed: {err}")
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # the step ends at the all-reduce, so both ranks see the slower one's time; take rank 0's
    figures, ratios = {}, {}
    for t in _eplb_tokens(args):
        off, on = got[0][("off", t)], got[0][("on", t)]
        log(f"EPLB, {t} tokens: step {off['step_ms']:.2f} ms -> {on['step_ms']:.2f} ms, rank-load imbalance "
            f"{off['imbalance']:.2f} -> {on['imbalance']:.2f}")
        figures[f"eplb_t{t}"] = {"off_step_ms": round(off["step_ms"], 3),
                                 "on_step_ms": round(on["step_ms"], 3),
                                 "imbalance_off": round(off["imbalance"], 3),
                                 "imbalance_on": round(on["imbalance"], 3),
                                 "hot_share_measured": round(off["hot_share"], 3),
                                 "spare_per_rank": on["spare_per_rank"], "layers": args.layers}
        ratios[f"eplb_step_t{t}"] = off["step_ms"] / on["step_ms"]
    return figures, ratios


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"layer: hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, intermediate {args.inter}, "
        f"{torch.get_num_threads()} threads")
    figures, ratios = layer_part(args)
    if not args.skip_eplb:
        f, r = eplb_part(args)
        figures.update(f)
        ratios.update(r)
    figures["shape"] = json.loads(json.dumps({k: getattr(args, k) for k in ("hidden", "experts", "top_k",
                                                                            "inter")}))
    return write_report(args.json, "moe", figures, ratios)


if __name__ == "__main__":
    main()
