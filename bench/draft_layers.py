"""EAGLE / MTP speculation through the real scheduler loop (part of `pdserve bench engine`).

No checkpoint this machine can get carries trained draft layers, so the bench measures the mechanism at
its two ends on the bench's own model, at full size (same matmuls, same KV):

* `exact`: the model with its layers' output projections zeroed (each next token then depends on the
  current one alone) and draft layers that compute the same function of their input token, so every
  draft is accepted: the most speculation can give here, at accept length `--speculative-num-steps` + 1;
* `random`: the same target with seeded random draft layers (the target's first layer with noise, a
  random `fc`), whose drafts are almost never accepted: what drafting costs when it does not pay.

A trained head lands between the two by its accept length. Both checkpoints are written once per
machine under `${PDSERVE_CACHE:-~/.cache/pdserve}` (the target's weights shared). Each run is
`bench/overlap.py`'s `decode_loop_run` with greedy requests; the plain runs use a runner without draft
layers on the same target, and tokens must be identical. Ratios `spec_mtp_exact` / `spec_mtp_random` =
decode tokens/s with speculation / without at batch 1 (`_b16` at 16).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import torch

from bench.speculative import compare_on_off
from common.config import ServerArgs
from common.models.default_model import cache_root
from common.models.tiny_model import exact_draft_head, random_draft_head
from common.runner import ModelRunner

VARIANTS = ("exact", "random")


def checkpoints(model_dir: str) -> dict[str, str]:
    """The `exact` and `random` checkpoints over `model_dir` (built once, then reused)."""
    from safetensors.torch import load_file, save_file

    from common.models.loader import safetensors_files

    key = hashlib.sha256(os.path.realpath(model_dir).encode()).hexdigest()[:12]
    root = os.path.join(cache_root(), f"draft-layers-{os.path.basename(os.path.normpath(model_dir))}-{key}")
    out = {v: os.path.join(root, v) for v in VARIANTS}
    if all(os.path.isfile(os.path.join(d, "mtp.safetensors")) for d in out.values()):
        return out
    tmp = root + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    w: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        w.update(load_file(f))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    hidden = int(config["hidden_size"])
    random_head = random_draft_head(w, hidden, seed=0)  # before the exact head zeroes the projections
    heads = {"exact": exact_draft_head(w, hidden), "random": random_head}
    save_file(w, os.path.join(tmp, "target.safetensors"), metadata={"format": "pt"})
    for name, head in heads.items():
        d = os.path.join(tmp, name)
        os.makedirs(d)
        for entry in os.listdir(model_dir):
            if not entry.endswith(".safetensors") and entry != "config.json" and \
                    os.path.isfile(os.path.join(model_dir, entry)):
                shutil.copy(os.path.join(model_dir, entry), d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, "mtp_num_hidden_layers": 1}, f, indent=1)
        os.symlink("../target.safetensors", os.path.join(d, "model.safetensors"))
        save_file({k: v.contiguous() for k, v in head.items()}, os.path.join(d, "mtp.safetensors"),
                  metadata={"format": "pt"})
    shutil.rmtree(root, ignore_errors=True)
    os.rename(tmp, root)
    return out


def measure(base_args: ServerArgs, model_dir: str,
            prompts_by_batch: dict[int, list[list[int]]], new_tokens: int,
            num_steps: int, repeats: int, log) -> tuple[dict, dict]:
    """Figures `spec_mtp_<variant>_b<B>` and ratios `spec_mtp_<variant>[_b<B>]` (batch 1 without suffix)."""
    figures, ratios = {}, {}
    spec = {"speculative_algorithm": "MTP", "speculative_num_steps": num_steps,
            "speculative_num_draft_tokens": None}
    for variant, d in checkpoints(model_dir).items():
        plain = ModelRunner(dataclasses.replace(base_args, model=d), d)
        spec_args = dataclasses.replace(base_args, model=d, **spec)
        spec_args.validate()
        drafting = ModelRunner(spec_args, d)
        for b, prompts in prompts_by_batch.items():
            best, decoded, stats = compare_on_off(plain, drafting, d, prompts, new_tokens, spec, repeats, log,
                                                  f"draft layers ({variant}) b{b}")
            figures[f"spec_mtp_{variant}_b{b}"] = {"num_steps": num_steps, "decoded_tokens": decoded,
                                                   "tok_s_plain": decoded / best[False],
                                                   "tok_s_spec": decoded / best[True],
                                                   "tokens_identical": True, **stats}
            ratios[f"spec_mtp_{variant}" + ("" if b == 1 else f"_b{b}")] = best[False] / best[True]
        del plain, drafting
    return figures, ratios
