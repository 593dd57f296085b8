"""Where a prefill's time goes (`pdserve bench engine`'s `prefill_phases`): one EXTEND forward of the real
`ModelRunner` with timing hooks on the model's modules, so the next gain is visible by phase.

Phases (seconds summed over the layers; the CPU engine runs synchronously, so a module's wall time between
its pre- and post-hook is its own):
  norms        every RMSNorm (the layers' two and the final one; q/k norms inside attention count there)
  qkv_proj     the fused q/k/v projection
  attention    the rest of the attention block: rotary, the KV cache write, the attention kernel, q/k norms
  o_proj       the output projection
  mlp          the MLP block (gate/up projection, SiLU-and-mul, down projection; the experts' block for
               a mixture-of-experts model)
  rest         the rest of the forward and the greedy sample: the embedding lookup, the last position's
               lm_head, the batch's move to the device, the model's own bookkeeping
A projection's rate (`gflops`) counts 2 x its weights x the rows it ran on (the last layer's MLP runs on
the rows whose logits are wanted alone: `LlamaForCausalLM.rows_going_on`).

The forwards measured run the layer modules: the native decoder stack (`common/models/decoder_stack.py`),
which the engine otherwise takes for such a prefill, chains the same kernels in one call, where no hook
can see them; it is set aside while they run. `bench engine`'s `ours_prefill` times the stack.
"""

from __future__ import annotations

import statistics
import time

import torch

PHASES = ("norms", "qkv_proj", "attention", "o_proj", "mlp", "rest")


def _modules(model) -> dict[str, list]:
    from common.layers.norm import RMSNorm

    layers = model.model.layers
    out = {"qkv_proj": [], "o_proj": [], "self_attn": [], "mlp": [], "norms": [model.model.norm]}
    for layer in layers:
        out["self_attn"].append(layer.self_attn)
        out["qkv_proj"].append(layer.self_attn.qkv_proj)
        out["o_proj"].append(layer.self_attn.o_proj)
        out["mlp"].append(layer.mlp)
        out["norms"] += [m for m in (layer.input_layernorm, layer.post_attention_layernorm)
                         if isinstance(m, RMSNorm)]
    return out


def _weights(mods: list) -> int:
    return sum(p.numel() for m in mods for p in m.parameters())


def measure(engine, prompt: list[int], repeats: int) -> dict:
    """The median over `repeats` forwards of each phase's seconds, its share of the forward, and the
    projections' GFLOP/s; `engine` is bench/engine.py's OurEngine."""
    mods = _modules(engine.runner.model)
    spent: dict[str, float] = {}
    flops: dict[str, float] = {}  # 2 x weights x rows, per phase, over one forward
    handles = []

    def hook(name: str, m) -> None:
        start = {}
        weights = _weights([m])

        def pre(_m, args):
            if args and isinstance(args[0], torch.Tensor):
                rows = args[0].numel() // args[0].shape[-1]
                flops[name] = flops.get(name, 0.0) + 2.0 * weights * rows
            start["t"] = time.perf_counter()

        def post(_m, _args, _out):
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start["t"]

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))

    for name, ms in mods.items():
        for m in ms:
            hook(name, m)
    runs: list[dict[str, float]] = []
    model = engine.runner.model
    stack = getattr(model, "decoder_stack", None)
    if stack is not None:
        model.decoder_stack = None  # the modules, so the hooks see every phase
    try:
        for _ in range(repeats):
            spent.clear()
            flops.clear()
            total = engine.prefill(prompt)
            got = {k: spent.get(k, 0.0) for k in mods}
            known = {"norms": got["norms"], "qkv_proj": got["qkv_proj"],
                     "attention": got["self_attn"] - got["qkv_proj"] - got["o_proj"], "o_proj": got["o_proj"],
                     "mlp": got["mlp"]}
            known["rest"] = total - sum(known.values())
            known["total"] = total
            runs.append(known)
    finally:
        for h in handles:
            h.remove()
        if stack is not None:
            model.decoder_stack = stack
    med = {k: statistics.median(r[k] for r in runs) for k in (*PHASES, "total")}
    n = len(prompt)
    out = {"prompt_tokens": n, "repeats": repeats, "seconds": med,
           "share": {k: med[k] / med["total"] for k in PHASES}, "gflops": {}}
    out["flops"] = {name: flops[name] for name in ("qkv_proj", "o_proj", "mlp")}
    for name in ("qkv_proj", "o_proj", "mlp"):
        out["gflops"][name] = flops[name] / med[name] / 1e9 if med[name] > 0 else None
    return out


def describe(p: dict) -> str:
    parts = [f"{k} {1e3 * p['seconds'][k]:.1f} ms ({100 * p['share'][k]:.0f} %)" for k in PHASES]
    rates = ", ".join(f"{k} {v:.0f}" for k, v in p["gflops"].items() if v)
    return f"prefill {p['prompt_tokens']} by phase: " + ", ".join(parts) + f"; GFLOP/s {rates}"

