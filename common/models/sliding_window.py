"""Sliding-window variants of the llama-family models: Mistral (`sliding_window`: every layer) and
Qwen2/Qwen3 (`use_sliding_window`: the layers from `max_window_layers` on, or the layers that
`layer_types` marks `sliding_attention`).

They are the llama-family models with the attention backend swapped for
`SlidingWindowAttentionBackend`, so contexts longer than the window are served exactly (keys older
than the window are masked, and not even gathered). `kv_window()` is the window when every layer is
windowed: then a request only ever reads the KV of its last `window` tokens, which is all a
prefill node has to send to a decode node (transfer `state_type` "swa"). Pipeline stages
(`--pp-size`) work as for the plain models: each stage's layers keep their own kind of attention.
"""

from __future__ import annotations

import torch

from common.layers.sliding_window import SlidingWindowAttentionBackend
from common.models.config import ModelConfig, ModelConfigError
from common.models.llama import MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


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


class _SlidingWindowMixin:
    def _install_sliding_window(self) -> None:
        cfg: ModelConfig = self.config
        self.window_layers = sliding_window_layers(cfg)
        self.sliding_window = cfg.sliding_window if self.window_layers else None
        if not self.window_layers:
            return
        backend = SlidingWindowAttentionBackend(cfg.num_heads // self.tp_size, cfg.local_kv_heads(self.tp_size),
                                                cfg.head_dim, int(cfg.sliding_window), self.window_layers,
                                                cfg.num_layers)
        self.attn_backend = backend
        for layer in self.model.layers:
            if hasattr(layer, "self_attn"):  # not a pipeline stage's MissingLayer
                layer.self_attn.backend = backend

    def kv_window(self) -> int | None:
        """The window if every KV layer is windowed (older tokens' KV is never read again), else None."""
        if self.sliding_window and len(self.window_layers) == self.config.num_layers:
            return int(self.sliding_window)
        return None


class SlidingWindowMistralForCausalLM(_SlidingWindowMixin, MistralForCausalLM):
    def __init__(self, config: ModelConfig, **kw) -> None:
        super().__init__(config, **kw)
        self._install_sliding_window()


class SlidingWindowQwen2ForCausalLM(_SlidingWindowMixin, Qwen2ForCausalLM):
    def __init__(self, config: ModelConfig, **kw) -> None:
        super().__init__(config, **kw)
        self._install_sliding_window()


class SlidingWindowQwen3ForCausalLM(_SlidingWindowMixin, Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, **kw) -> None:
        super().__init__(config, **kw)
        self._install_sliding_window()


SLIDING_WINDOW_ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    "MistralForCausalLM": SlidingWindowMistralForCausalLM,
    "Qwen2ForCausalLM": SlidingWindowQwen2ForCausalLM,
    "Qwen3ForCausalLM": SlidingWindowQwen3ForCausalLM,
}
