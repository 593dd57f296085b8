"""Load a Hugging Face-format model directory: config.json + safetensors (one file or shards with
`model.safetensors.index.json`), mapped onto the fused parameters and sliced for a TP rank.

Architectures are looked up in `ARCHITECTURES` by `config.json["architectures"][0]`; a hybrid model
(e.g. Qwen3.5 with linear attention, per-request state slots via `fb.state_indices`) or a
sliding-window variant plugs in as another entry whose class takes the same constructor arguments
and exposes `forward(fb)`, `attn_backend` and `load_weights(...)`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from common.fingerprint import checkpoint_digest, dummy_digest
from common.layers.eplb import EplbSettings
from common.layers.linear import pack_linears
from common.models.attention import attention_backend_for
from common.models.config import ModelConfig, ModelConfigError
from common.models.deepseek_v3 import DeepseekV3ForCausalLM
from common.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    ModelLoadError,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from common.models.moe_llama import MixtralForCausalLM, Qwen3MoeForCausalLM
from common.models.mtp import draft_layer_count
from common.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from common.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration
from common.models.sliding_window import SLIDING_WINDOW_ARCHITECTURES

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}

__all__ = ["ARCHITECTURES", "ModelConfig", "ModelConfigError", "ModelLoadError", "UnsupportedArchitecture",
           "get_model_class", "load_model", "iter_safetensors", "weights_digest"]

DUMMY_SEED = 0  # the seed of `--load-format dummy`'s random fill


class UnsupportedArchitecture(ModelConfigError):
    pass


LLAMA_FAMILY = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
HYBRID = (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
          Qwen3_5MoeForConditionalGeneration)


def get_model_class(architecture: str) -> type[torch.nn.Module]:
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise UnsupportedArchitecture(
            f"unsupported model architecture {architecture!r} (config.json 'architectures'); "
            f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelLoadError(f"{model_dir}: shard(s) named in model.safetensors.index.json are missing: "
                                 f"{', '.join(missing)}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (only safetensors checkpoints are "
                             f"supported; convert a .gguf with `pdserve convert`)")
    return [os.path.join(model_dir, f) for f in files]


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
               dtype: torch.dtype = torch.float32, quantization: str | None = None, pp_rank: int = 0,
               pp_size: int = 1, draft_layers: bool = False, device: torch.device | str = "cpu",
               attention_backend: str = "native", load_format: str = "auto", ep_size: int = 1,
               eplb: EplbSettings | None = None) -> tuple[torch.nn.Module, ModelConfig]:
    """Build the model for `config.json["architectures"][0]` (pipeline stage `pp_rank` of `pp_size`: its
    layers only) on `device`, with the `attention_backend` the runner chose, and fill it from the
    safetensors (`load_format` "dummy": seeded random weights, nothing read but config.json); its linear
    weights packed for the CPU kernels (`common/layers/linear.py`), as int8 with `quantization` ("int8wo"
    weight-only, "w8a8_int8" with int8 activations). `draft_layers`: the checkpoint's `mtp.*` draft layers too
    (common/models/mtp.py), for EAGLE / MTP speculation. `ep_size`, `eplb`: expert parallelism over the TP
    ranks and its balancer (mixture-of-experts models only, common/layers/eplb.py)."""
    device = torch.device(device)
    config = ModelConfig.from_pretrained(model_dir)
    cls = get_model_class(config.architecture)
    if config.sliding_window and config.architecture in SLIDING_WINDOW_ARCHITECTURES:
        # windowed attention layers (common/models/sliding_window.py): any context length is exact
        cls = SLIDING_WINDOW_ARCHITECTURES[config.architecture]
    config.local_kv_heads(tp_size)  # validates the head split
    files = safetensors_files(model_dir) if load_format != "dummy" else []
    stage = {}
    if pp_size > 1:
        if pp_size > config.num_layers:
            raise ModelLoadError(f"--pp-size {pp_size}: {config.name} has only {config.num_layers} layers")
        stage = {"pp_rank": pp_rank, "pp_size": pp_size}
    if draft_layers:
        if cls not in LLAMA_FAMILY and cls not in HYBRID:
            raise ModelLoadError("--speculative-algorithm EAGLE/MTP: draft layers are supported on "
                                 "Llama-family models without sliding windows and on Qwen3.5, not "
                                 f"{config.architecture}"
                                 + (" with a sliding window" if config.sliding_window else ""))
        if not draft_layer_count(config.raw):
            raise ModelLoadError(f"--speculative-algorithm EAGLE/MTP: {config.name} carries no draft layers "
                                 "(its config.json has no mtp_num_hidden_layers / num_nextn_predict_layers); "
                                 "NGRAM needs none")
        stage["draft_layers"] = True
    from common.distributed import get_dp_attention

    if ep_size > 1 or eplb is not None or get_dp_attention() is not None:
        if not getattr(cls, "expert_parallel", False):  # a class taking ep_size / eplb
            raise ModelLoadError(f"--ep-size / --enable-eplb / --enable-dp-attention: {config.architecture} "
                                 "has no expert layers this node can split")
        stage.update(ep_size=ep_size, eplb=eplb)
    backend = attention_backend_for(config, attention_backend, tp_size, device,
                                    windows=cls not in HYBRID and cls is not DeepseekV3ForCausalLM)
    # on a GPU every parameter and buffer is made there; on the CPU nothing changes
    with torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
        model = cls(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                    dtype=dtype, attn_backend=backend, **stage)
    if load_format == "dummy":
        fill_random(model, float(config.raw.get("initializer_range", 0.02)), DUMMY_SEED)
    else:
        loaded = model.load_weights(iter_safetensors(files))
        missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ModelLoadError(f"{model_dir}: weights missing from the checkpoint: {shown}")
    model.eval()
    pack_linears(model, quantization)
    logger.info("loaded %s (%s, %d layers%s) tp %d/%d on %s (%s, %s attention)%s",
                config.name, config.architecture,
                config.num_layers, f", stage {pp_rank}/{pp_size}: layers {model.layer_range[0]}.."
                f"{model.layer_range[1] - 1}" if pp_size > 1 else "", tp_rank, tp_size, device,
                str(dtype).removeprefix("torch."), backend.name,
                f", weights {quantization}" if quantization else "")
    return model, config


def weights_digest(model_dir: str, load_format: str = "auto", tp_size: int = 1, pp_size: int = 1) -> str:
    """The digest of the weights `load_model` fills the model of `model_dir` with (common/fingerprint.py): of
    its config as parsed and its checkpoint's tensors as stored, a few KiB of each read through the
    safetensors header, the same on every rank; for `load_format` "dummy" of the config, the fill's seed and
    spread and the node's TP / PP shape (each rank fills its own shard)."""
    config = ModelConfig.from_pretrained(model_dir)  # as read, before a model's constructor adjusts it
    facts = config.to_dict()
    if load_format == "dummy":
        return dummy_digest(facts, DUMMY_SEED,
                            float(config.raw.get("initializer_range", 0.02)), tp_size, pp_size)
    files = safetensors_files(model_dir)
    try:
        return checkpoint_digest(files, facts)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{model_dir}: could not read the checkpoint's tensors for its "
                             f"digest: {e}") from e


@torch.no_grad()
def fill_random(model: torch.nn.Module, std: float, seed: int = DUMMY_SEED) -> None:
    """`--load-format dummy`: every parameter drawn from N(0, std) (norm weights set to one), on the device it
    is on, from a seeded generator: the same model every time, nothing read from disk."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        g = gens.get(p.device)
        if g is None:
            g = gens[p.device] = torch.Generator(device=p.device)
            g.manual_seed(seed)
        if "norm" in name.rsplit(".", 2)[-2] and p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=g)
