"""Sliding-window variants of the llama-family models: Mistral (`sliding_window`: every layer) and
Qwen2/Qwen3 (`use_sliding_window`: the layers from `max_window_layers` on, or the layers that
`layer_types` marks `sliding_attention`).

They are the llama-family models whose attention backend (`common/models/attention.py`) masks the
window on the windowed layers, so contexts longer than the window are served exactly (keys older
than the window are masked, and not even gathered). `kv_window()` is the window when every layer is
windowed: then a request only ever reads the KV of its last `window` tokens, which is all a
prefill node has to send to a decode node (transfer `state_type` "swa"). Pipeline stages
(`--pp-size`) work as for the plain models: each stage's layers keep their own kind of attention.
"""

from __future__ import annotations

import torch

from common.models.attention import sliding_window_layers
from common.models.config import ModelConfig
from common.models.llama import MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class _SlidingWindowMixin:
    def _install_sliding_window(self) -> None:
        cfg: ModelConfig = self.config
        self.window_layers = sliding_window_layers(cfg)
        self.sliding_window = cfg.sliding_window if self.window_layers else None
        if self.window_layers and self.attn_backend.window_layers != frozenset(self.window_layers):
            raise ValueError(f"{cfg.name}: the attention backend's window layers "
                             f"{sorted(self.attn_backend.window_layers)} are not the model's "
                             f"{self.window_layers}")

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
