"""Llama-family decoder (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with per-head q/k RMSNorm).

Tensor parallelism: attention heads and the MLP's intermediate features are split over ranks
(q/k/v and gate/up are column parallel and fused into one matmul each; o_proj and down_proj are
row parallel, all-reduced). The embedding and the lm_head are replicated, so every rank computes
identical full-vocab logits.

`forward(fb)` runs the attention backend's `init_forward_metadata(fb)` itself when
`fb.attn_metadata` is None (callers that build metadata ahead of time may do so; it is reused).

Pipeline parallelism (`pp_rank` of `pp_size`, common/models/pipeline.py): the stage holds its
`layer_range` of layers and runs its part of each forward with `forward_stage`. Embedding, final norm
and lm_head exist on every stage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.activation import silu_and_mul
from common.layers.attention_backend import AttentionBackend
from common.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    linear,
)
from common.layers.moe import expert_target
from common.layers.norm import RMSNorm, default_weight_loader
from common.layers.rotary import RotaryEmbedding
from common.models.attention import attention_backend_for
from common.models.config import ModelConfig
from common.models.decoder_stack import DecoderStack
from common.models.mtp import MtpHead
from common.models.pipeline import MissingLayer, forward_stage, layer_range

logger = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The checkpoint does not fit the model (missing or misshapen weights)."""


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, tp_group, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu)")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias,
                                                       tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp_rank=tp_rank,
                                           tp_size=tp_size, tp_group=tp_group, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def dense_mlp(cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, tp_group,
              dtype: torch.dtype) -> nn.Module:
    return LlamaMLP(cfg, tp_rank, tp_size, tp_group, dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend, tp_rank: int,
                 tp_size: int, tp_group, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias,
                                          tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.attention_bias,
                                        tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qs, ks = self.q_size, self.kv_size
        if self.qk_norm:
            q = self.q_norm(qkv[:, :qs].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, qs:qs + ks].view(t, self.num_kv_heads, self.head_dim))
            q = RotaryEmbedding.apply(q, cos, sin).view(t, qs)
            k = RotaryEmbedding.apply(k, cos, sin).view(t, ks)
        else:
            # q and k heads rotated together in one pass
            qk = RotaryEmbedding.apply(qkv[:, :qs
                                           + ks].view(t, self.num_heads + self.num_kv_heads, self.head_dim),
                                       cos, sin).view(t, qs + ks)
            q, k = qk[:, :qs], qk[:, qs:]
        o = self.backend.forward(q, k, qkv[:, qs + ks:], self.layer_id, fb)
        return self.o_proj(o)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend, tp_rank: int,
                 tp_size: int, tp_group, dtype: torch.dtype, make_mlp=dense_mlp) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, backend, tp_rank, tp_size, tp_group, dtype)
        # a mixture-of-experts model builds its sparse block here (common/models/moe_llama.py)
        self.mlp = make_mlp(cfg, layer_id, tp_rank, tp_size, tp_group, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows`: only these rows go on past the attention (which still stores every token's K and V);
        the last layer's, when only their logits are wanted (`LlamaForCausalLM.rows_going_on`)."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, fb)
        if rows is not None:
            h, residual = h[rows], residual[rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp_rank: int, tp_size: int,
                 tp_group, dtype: torch.dtype, layers: tuple[int, int] | None = None,
                 make_mlp=dense_mlp) -> None:
        super().__init__()
        start, end = layers or (0, cfg.num_layers)
        # no random init: every weight comes from the checkpoint (the loader refuses a missing one)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = default_weight_loader
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, backend, tp_rank, tp_size, tp_group, dtype, make_mlp)
            if start <= i < end else MissingLayer() for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


_UNSET = object()


class LlamaForCausalLM(nn.Module):
    decoder_stack = _UNSET  # common/models/decoder_stack.py: decode steps and prefills in one native call
    make_mlp = staticmethod(dense_mlp)  # each layer's MLP (a sparse block in a mixture-of-experts model)
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, pp_rank: int = 0, pp_size: int = 1,
                 draft_layers: bool = False, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.layer_range = layer_range(config.num_layers, pp_rank, pp_size)
        self.micro_batches = 0  # run by pipelined forwards (in forwards cut into more than one)
        # the runner's choice (--attention-backend); the CPU's native kernels for a model built on its own
        self.attn_backend = attn_backend or attention_backend_for(config, "native", tp_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta,
                                      config.rope_type, config.rope_scaling, dtype)
        self.model = LlamaModel(config, self.attn_backend, tp_rank, tp_size, tp_group,
                                dtype, self.layer_range, self.make_mlp)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, dtype=dtype)
        # the checkpoint's draft layers (`mtp.*`, common/models/mtp.py) for EAGLE / MTP speculation
        self.mtp = MtpHead(config, LlamaDecoderLayer(config, config.num_layers, self.attn_backend, tp_rank,
                                                     tp_size, tp_group, dtype, self.make_mlp),
                           dtype) if draft_layers else None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        if self.pp_size > 1:
            return self._forward_stage(fb)
        if fb.attn_metadata is None:
            self.attn_backend.init_forward_metadata(fb)
        h = F.embedding(fb.input_ids, self.model.embed_tokens.weight)
        cos, sin = self.rotary.cos_sin(fb.positions)
        if self.decoder_stack is _UNSET:  # decided once, after the weights were packed
            self.decoder_stack = DecoderStack.for_model(self)
        rows = self.rows_going_on(fb) if fb.mode == ForwardMode.EXTEND else None
        if self.decoder_stack is not None and self.decoder_stack.accepts(fb):
            h, residual = self.decoder_stack.run(h, cos, sin, fb, rows)
            return final_logits(self, h, residual, fb, rows_taken=rows is not None)
        residual = None
        layers = self.model.layers
        for layer in layers[:-1] if rows is not None else layers:
            h, residual = layer(h, residual, cos, sin, fb)
        if rows is not None:
            h, residual = layers[-1](h, residual, cos, sin, fb, rows)
        return final_logits(self, h, residual, fb, rows_taken=rows is not None)

    def rows_going_on(self, fb: ForwardBatch) -> torch.Tensor | None:
        """The rows whose logits an extend wants (the last new token of each request, or
        `fb.logits_indices`), when the last layer's MLP need not run on the others: no row's hidden state
        is kept (`keep_hidden`) and its MLP is dense (a sparse block's expert statistics count every
        token). A 512-token prefill of SmolLM2 then skips a thirtieth of its MLP work. None: every row."""
        if fb.mode != ForwardMode.EXTEND or fb.extras.get("keep_hidden") \
                or not isinstance(self.model.layers[-1], LlamaDecoderLayer) \
                or not isinstance(self.model.layers[-1].mlp, LlamaMLP):
            return None
        idx = fb.logits_indices if fb.logits_indices is not None else fb.last_token_indices()
        return idx if idx.numel() < fb.input_ids.shape[0] else None

    def _forward_stage(self, fb: ForwardBatch) -> torch.Tensor | None:
        def run_layers(h, residual, cos, sin, part):
            for layer in self.model.layers[start:end]:
                h, residual = layer(h, residual, cos, sin, part)
            return h, residual

        start, end = self.layer_range
        return forward_stage(self, fb, run_layers, final_logits)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names of the parameters
        that were filled (a fused one once all its parts came)."""
        return load_checkpoint(self, weights, {"qkv_proj": 3, "gate_up_proj": 2})


def final_logits(model: nn.Module, h: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch,
                 rows_taken: bool = False) -> torch.Tensor:
    """Final norm + lm_head on the rows whose logits are wanted (`fb.logits_indices`; by default the
    last new token of each request, every row in decode); `rows_taken`: h and residual are those rows
    already. With `fb.extras["keep_hidden"]` every row's normed hidden state is kept in
    `fb.extras["hidden"]` (the draft layers read it)."""
    idx = None if rows_taken else fb.logits_indices
    if idx is None and fb.mode != ForwardMode.DECODE and not rows_taken:
        idx = fb.last_token_indices()
    if fb.extras.get("keep_hidden"):
        h, _ = model.model.norm(h, residual)
        fb.extras["hidden"] = h
        if idx is not None:
            h = h[idx]
    else:
        if idx is not None:
            h, residual = h[idx], residual[idx]
        h, _ = model.model.norm(h, residual)
    if model.lm_head is not None:
        return model.lm_head(h)
    return linear(h, model.lm_head_weight, getattr(model, "lm_head_packed", None))


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    parts_needed: dict[str, int],
                    rename=None, skipped_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Load HF-named tensors into `model`, routing the pieces of fused projections
    (`model.stacked_params`: checkpoint fragment, our fragment, shard id) to their parameter's
    weight loader. `parts_needed` maps a fused parameter to its number of pieces; `rename` maps
    checkpoint names first (e.g. a multimodal checkpoint's language-model prefix)."""
    params = dict(model.named_parameters())
    parts_seen: dict[str, set] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if rename is not None:
            name = rename(name)
        if (skipped_prefixes and name.startswith(skipped_prefixes)) or "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied to the embedding
        target, shard = name, None
        expert = expert_target(name)  # one expert's tensor, or the stacked experts (common/layers/moe.py)
        if expert is not None:
            target, shard = expert
        else:
            for ckpt_frag, our_frag, shard_id in model.stacked_params:
                if ckpt_frag in name:
                    target, shard = name.replace(ckpt_frag, our_frag), shard_id
                    break
        param = params.get(target)
        if param is None:
            logger.debug("checkpoint tensor %s has no place in the model; skipped", name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except (ValueError, RuntimeError) as e:  # shape mismatch, slice out of range
            raise ModelLoadError(f"cannot load {name} (shape {tuple(tensor.shape)}): {e}") from e
        if shard is None:
            loaded.add(target)
        else:
            parts_seen.setdefault(target, set()).add(shard)
    for target, seen in parts_seen.items():
        needed = getattr(params[target], "parts_total", None) or parts_needed[target.split(".")[-2]]
        if len(seen) >= needed:
            loaded.add(target)
    return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
