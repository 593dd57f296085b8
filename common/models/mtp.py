"""Draft layers carried by a checkpoint (`mtp.*`, multi-token prediction), for
`--speculative-algorithm EAGLE` / `MTP` (common/mtp.py runs them).

The head takes, at position p, the target model's final hidden state h_p (after its last norm) and the
embedding of the token at p + 1, and predicts the token at p + 2:

    x = fc(concat(pre_fc_norm_embedding(embed(x_(p+1))), pre_fc_norm_hidden(h_p)))
    x = decoder layer (self-attention over its own KV at positions 0..p, then the MLP)
    g_p = norm(x);  logits = lm_head(g_p)      (the target's embedding and lm_head, shared)

Weight names follow Qwen3-Next / Qwen3.5 (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`); the config says how many layers
(`mtp_num_hidden_layers`, or DeepSeek's `num_nextn_predict_layers`); one is used. The layer is the
model's own decoder layer with id `num_layers` (for Qwen3.5, a gated full-attention layer, and its
norms scale by 1 + weight), so its KV lives in the same paged pool as one more
layer (same slots, same pages: it moves with the rest across PD). g_p stands in for h_(p+1) when the
head drafts a chain of tokens past the last one the target has seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.layers.linear import ReplicatedLinear, linear
from common.layers.norm import RMSNorm


def draft_layer_count(raw: dict) -> int:
    """How many draft layers the checkpoint's config declares (0: none)."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if raw.get(key):
            return int(raw[key])
    return 0


class MtpHead(nn.Module):
    """`layer`: the model's own decoder layer kind (a full-attention one), id `num_layers`; `norm`: the
    model's RMSNorm kind (Qwen3.5 scales by 1 + weight)."""

    def __init__(self, cfg, layer: nn.Module, dtype: torch.dtype, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layer_id = cfg.num_layers
        self.fc = ReplicatedLinear(2 * h, h, dtype=dtype)
        self.pre_fc_norm_embedding = norm(h, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = norm(h, cfg.rms_norm_eps, dtype)
        self.layers = nn.ModuleList([layer])
        self.norm = norm(h, cfg.rms_norm_eps, dtype)

    def forward(self, model: nn.Module, fb, hidden: torch.Tensor) -> torch.Tensor:
        """g for every row of `fb` (its `input_ids` are the next tokens, `hidden` the target's or the
        head's own previous g): `[T, hidden]`; writes the draft layer's KV at `fb.out_cache_loc`."""
        if fb.attn_metadata is None:
            model.attn_backend.init_forward_metadata(fb)
        e = self.pre_fc_norm_embedding(F.embedding(fb.input_ids, model.model.embed_tokens.weight))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = model.rotary.cos_sin(fb.positions)
        x, residual = self.layers[0](x, None, cos, sin, fb)
        g, _ = self.norm(x, residual)
        return g

    @staticmethod
    def logits(model: nn.Module, g: torch.Tensor) -> torch.Tensor:
        if model.lm_head is not None:
            return model.lm_head(g)
        return linear(g, model.lm_head_weight, getattr(model, "lm_head_packed", None))
