"""A model's attention backend, made from its config: this TP rank's heads, and the layers that use a
sliding window (Mistral's `sliding_window` on every layer; Qwen2/Qwen3's `use_sliding_window` from
`max_window_layers` on; any model's `layer_types` marking `sliding_attention`).

The runner calls `attention_backend_for(cfg, --attention-backend, tp_size, device)` and hands the
backend to the model's constructor; a model built without one (tests, tools) gets the CPU's native one.
"""

from __future__ import annotations

import torch

from common.layers.attention_backend import AttentionBackend, create_attention_backend
from common.models.config import ModelConfig, ModelConfigError


def sliding_window_layers(cfg: ModelConfig) -> list[int]:
    """Layer ids that use the sliding window (empty when the model has none)."""
    if not cfg.sliding_window:
        return []
    raw = cfg.raw
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != cfg.num_layers:
            raise ModelConfigError(f"layer_types lists {len(types)} layers, the model has {cfg.num_layers}")
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if "use_sliding_window" in raw or cfg.model_type in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return []
        first = int(raw.get("max_window_layers", 0) or 0)
        return list(range(first, cfg.num_layers))
    return list(range(cfg.num_layers))


def attention_backend_for(cfg: ModelConfig, name: str = "native", tp_size: int = 1,
                          device: torch.device | str = "cpu", windows: bool = True) -> AttentionBackend:
    """The backend `name` for this rank's share of `cfg`'s heads (`windows=False`: the model has no
    sliding-window layers whatever its config says, as Qwen3.5's full-attention layers)."""
    layers = sliding_window_layers(cfg) if windows else []
    return create_attention_backend(name, cfg.num_heads // tp_size, cfg.local_kv_heads(tp_size), cfg.head_dim,
                                    scaling=cfg.attn_scale, window_layers=layers,
                                    window=int(cfg.sliding_window) if layers else None, device=device)
