"""Which GPUs each node of a local cluster runs on: `pdserve cluster --device cuda [--gpu-ids 0,1,...]`.

The launcher's `--device` decides where the nodes run:
* not given: the nodes keep their own default (`--device auto`) and nothing is placed, as before;
* `cpu`, or `auto` on a machine where torch sees no GPU: the flag reaches every node unchanged and the
  CPU placement (deploy/placement.py, `--cpu-affinity`) is all there is;
* `cuda`, or `auto` where torch sees a GPU: the nodes are placed on the GPUs of `--gpu-ids` (default:
  every GPU torch sees, numbered as torch numbers them, i.e. after `CUDA_VISIBLE_DEVICES`, which the
  nodes inherit). `--device cuda` where torch sees none is an error before anything starts.

The rule. A node needs `tp x dp-size` GPUs (its `--tp` and `--dp-size`, read from the flags it gets:
the common node flags and then its role's `--prefill-args` / `--decode-args`). Nodes are taken in order,
prefill nodes first, and each takes the next GPUs of `--gpu-ids`:
* when there are enough GPUs for every node to have its own, each node takes consecutive ids of the
  list and runs alone on them; GPUs left over stay unused;
* with fewer GPUs than the nodes need, the nodes go round the list (a node that would run past its end
  wraps to its start, or starts again at the front where the wrapped ids would not be evenly spaced),
  so nodes share GPUs; every node on a shared GPU gets `--mem-fraction-static`, its share of
  `SHARED_BUDGET` of the GPU's memory (the budget split evenly between the nodes there, floored to a
  hundredth; the smallest of its shares for a node on several), so that their weights and KV pools fit
  side by side. A node that already has
  `--mem-fraction-static F` among its flags keeps F; the fractions given on one GPU may add up to
  `MAX_GIVEN` at most, and the nodes there without one split what is left of the budget.
A node's ranks run on GPU `--base-gpu-id + r * --gpu-id-step` (common/device.py), so its GPUs must be
evenly spaced ids; the node's group is sorted, and a group that is not evenly spaced is refused with
an error that names it. The plan is a set of extra flags per node (`--device cuda --base-gpu-id B
--gpu-id-step S [--mem-fraction-static F]`); those flags are the launcher's, so the node flags may not
set `--device`, `--base-gpu-id` or `--gpu-id-step` themselves. `describe()` is what the launcher prints.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

# the share of a shared GPU's memory the nodes on it take together, when none of them is given a fraction
SHARED_BUDGET = 0.88
# the most that the fractions given with --mem-fraction-static may add up to on one GPU
MAX_GIVEN = 0.95
# flags that the placement sets on each node
PLACED_FLAGS = ("--device", "--base-gpu-id", "--gpu-id-step")


@dataclass
class NodeGpus:
    """Where one node runs: its GPU ids (sorted, evenly spaced), the nodes it shares them with, and the
    --mem-fraction-static the plan gives it (None: none added; `given`: the node's own flags have one)."""

    name: str
    gpus: list[int]
    shared_with: list[str] = field(default_factory=list)
    fraction: float | None = None
    given: float | None = None

    def flags(self) -> list[str]:
        step = self.gpus[1] - self.gpus[0] if len(self.gpus) > 1 else 1
        out = ["--device", "cuda", "--base-gpu-id", str(self.gpus[0]), "--gpu-id-step", str(step)]
        return out + (["--mem-fraction-static", f"{self.fraction:.2f}"] if self.fraction is not None else [])

    def describe(self) -> str:
        where = ",".join(f"cuda:{g}" for g in self.gpus)
        notes = []
        if self.shared_with:
            notes.append("shared with " + ", ".join(self.shared_with))
        if self.fraction is not None:
            notes.append(f"--mem-fraction-static {self.fraction:.2f}")
        elif self.given is not None:
            notes.append(f"--mem-fraction-static {self.given:g} given")
        return f"  {self.name}: {where}" + (f" ({', '.join(notes)})" if notes else "")


@dataclass
class GpuPlan:
    """The device flags of every node. `device` is "cuda" for a placement (`nodes` by name), else the
    `--device` value every node gets unchanged ("cpu", or "auto" where torch sees no GPU)."""

    device: str
    nodes: dict[str, NodeGpus] = field(default_factory=dict)
    gpu_ids: list[int] = field(default_factory=list)
    shared: bool = False

    def node_flags(self, name: str | None) -> list[str]:
        """The flags node `name` gets from the plan."""
        if self.device != "cuda":
            return ["--device", self.device]
        if name not in self.nodes:
            raise KeyError(f"the GPU placement has no node {name!r}")
        return self.nodes[name].flags()

    def describe(self) -> str:
        """One line for the plan, then one per node ("" when nothing was placed)."""
        if self.device != "cuda":
            return ""
        used = {g for n in self.nodes.values() for g in n.gpus}
        how = "fewer GPUs than the nodes need: shared round-robin" if self.shared \
            else "GPUs of its own per node"
        lines = [f"GPU placement ({how}; --gpu-ids {','.join(map(str, self.gpu_ids))}):"]
        lines += [n.describe() for n in self.nodes.values()]
        unused = [g for g in self.gpu_ids if g not in used]
        if unused:
            lines.append("  unused: " + ",".join(f"cuda:{g}" for g in unused))
        return "\n".join(lines)


def visible_gpu_count() -> int:
    """The GPUs torch sees (after CUDA_VISIBLE_DEVICES); torch is imported only here."""
    import torch

    return torch.cuda.device_count()


def parse_gpu_ids(text: str, count: int) -> list[int]:
    """"0,2,3" -> [0, 2, 3]: ids of visible GPUs, each once, in the order given."""
    ids: list[int] = []
    for word in text.split(","):
        word = word.strip()
        try:
            gpu = int(word)
        except ValueError:
            raise ValueError(f"--gpu-ids: {word!r} is not a GPU id (comma-separated integers, "
                             "e.g. 0,1)") from None
        if gpu < 0:
            raise ValueError(f"--gpu-ids: GPU ids are >= 0, got {gpu}")
        if gpu in ids:
            raise ValueError(f"--gpu-ids: GPU {gpu} is listed twice")
        if gpu >= count:
            seen = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(f"--gpu-ids: no GPU {gpu}: torch sees {count} (ids 0-{count - 1}"
                             + (f", CUDA_VISIBLE_DEVICES={seen}" if seen is not None else "") + ")")
        ids.append(gpu)
    return ids


def _evenly_spaced(gpus: list[int]) -> bool:
    return len({b - a for a, b in zip(gpus, gpus[1:], strict=False)}) <= 1


def place(needs: list[tuple[str, int, float | None]], gpu_ids: list[int]) -> GpuPlan:
    """The plan for nodes `needs` = [(name, GPUs it needs, its given --mem-fraction-static or None)], in
    start order (prefill nodes first), on `gpu_ids`. ValueError naming the flag when it cannot be done."""
    if not gpu_ids:
        raise ValueError("--gpu-ids: no GPU to place the nodes on")
    n = len(gpu_ids)
    shared = sum(need for _, need, _ in needs) > n
    plan = GpuPlan("cuda", gpu_ids=list(gpu_ids), shared=shared)
    start = 0
    for name, need, given in needs:
        if need > n:
            raise ValueError(f"--gpu-ids: {name} needs {need} GPUs (--tp x --dp-size) and --gpu-ids "
                             f"gives {n}")
        group = sorted(gpu_ids[(start + k) % n] for k in range(need))
        if not _evenly_spaced(group) and start + need > n:
            start = 0  # the wrapped group is not expressible: start again at the front of the list
            group = sorted(gpu_ids[:need])
        if not _evenly_spaced(group):
            raise ValueError(f"--gpu-ids: {name} would run on GPUs {','.join(map(str, group))}, which are "
                             "not evenly spaced (a node's ranks run on --base-gpu-id + rank x "
                             "--gpu-id-step); list the ids so that each node's consecutive ones are")
        plan.nodes[name] = NodeGpus(name, group, given=given)
        start = (start + need) % n
    _share_memory(plan)
    return plan


def _share_memory(plan: GpuPlan) -> None:
    """Fill in who shares a GPU with whom and the --mem-fraction-static of the nodes on shared GPUs."""
    on_gpu: dict[int, list[NodeGpus]] = {}
    for node in plan.nodes.values():
        for g in node.gpus:
            on_gpu.setdefault(g, []).append(node)
    for g, nodes in on_gpu.items():
        if len(nodes) < 2:
            continue
        for node in nodes:
            node.shared_with += [o.name for o in nodes if o is not node and o.name not in node.shared_with]
        given = [x for x in nodes if x.given is not None]
        total = sum(x.given for x in given)
        if total > MAX_GIVEN + 1e-9:
            parts = " + ".join(f"{x.name} {x.given:g}" for x in given)
            raise ValueError(f"--mem-fraction-static: cuda:{g} holds {parts} = {total:.2f}, more than the "
                             f"{MAX_GIVEN:g} the nodes on one GPU may take together; lower it, or give the "
                             "nodes more GPUs (--gpu-ids)")
        rest = [x for x in nodes if x.given is None]
        if not rest:
            continue
        share = math.floor((SHARED_BUDGET - total) / len(rest) * 100 + 1e-6) / 100
        if share < 0.01:
            raise ValueError(f"--mem-fraction-static: the fractions given on cuda:{g} ({total:.2f}) leave no "
                             f"memory of the {SHARED_BUDGET:g} budget for {', '.join(x.name for x in rest)}")
        for node in rest:  # a node on several shared GPUs takes its smallest share
            node.fraction = share if node.fraction is None else min(node.fraction, share)


def _has_flag(flags: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in flags)


def plan_from_flags(device: str | None, gpu_ids: str | None, num_prefill: int, num_decode: int,
                    node_args: list[str], prefill_args: list[str], decode_args: list[str],
                    parser: argparse.ArgumentParser, gpu_count: int | None = None) -> GpuPlan | None:
    """The plan for the launcher's `--device` / `--gpu-ids` (None: `--device` not given, nothing
    changes). `parser` reads the node flags (deploy.nodes.node_parser()); `gpu_count` stands in for
    the GPUs torch sees (None: ask torch)."""
    roles = (("prefill", num_prefill, node_args + prefill_args),
             ("decode", num_decode, node_args + decode_args))
    if device is None:
        if gpu_ids is not None:
            raise ValueError("--gpu-ids: places the nodes with --device cuda (or auto); give --device too")
        return None
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device: auto, cpu or cuda, got {device!r}")
    for role, _, flags in roles:
        if _has_flag(flags, "--device"):
            raise ValueError(f"--device: given to the launcher and in the {role} nodes' flags; give it once")
    count = 0 if device == "cpu" else (visible_gpu_count() if gpu_count is None else gpu_count)
    if count == 0:
        if device == "cuda":
            seen = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError("--device cuda: torch sees no GPU on this machine"
                             + (f" (CUDA_VISIBLE_DEVICES={seen!r})" if seen is not None else "")
                             + "; use --device cpu or auto")
        if gpu_ids is not None:
            raise ValueError(f"--gpu-ids: no GPU to choose from with --device {device}"
                             + ("" if device == "cpu" else " (torch sees none)"))
        return GpuPlan(device)
    ids = parse_gpu_ids(gpu_ids, count) if gpu_ids is not None else list(range(count))
    needs: list[tuple[str, int, float | None]] = []
    for role, n, flags in roles:
        for flag in PLACED_FLAGS[1:]:
            if _has_flag(flags, flag):
                raise ValueError(f"{flag}: set by the GPU placement of --device {device}; choose the GPUs "
                                 f"with --gpu-ids instead of giving the {role} nodes {flag}")
        ns, _ = parser.parse_known_args(flags)
        if ns.tp < 1 or ns.dp_size < 1:
            raise ValueError(f"--tp and --dp-size of the {role} nodes must be >= 1, got {ns.tp} and "
                             f"{ns.dp_size}")
        needs += [(f"{role}-{i}", ns.tp * ns.dp_size, ns.mem_fraction_static) for i in range(n)]
    return place(needs, ids)
