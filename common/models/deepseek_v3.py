"""DeepSeek-V3 (transformers' `DeepseekV3ForCausalLM`): multi-head latent attention (MLA) and a
mixture of experts with sigmoid routing and a shared expert, on the Llama decoder's layer loop.

Attention. Each token's hidden state x is compressed into a latent row: `kv_a_proj_with_mqa(x)` is split
into c (`kv_lora_rank` features, RMS-normed by `kv_a_layernorm`) and k_pe (`qk_rope_head_dim` features,
rotated by the position, shared by every head). Transformers expands c per head with `kv_b_proj` into
k_nope (`qk_nope_head_dim`) and v (`v_head_dim`) and runs ordinary attention. We never expand the cache:
* scores: q_nope[h] . k_nope[h] = q_nope[h] . (W_UK[h] c) = (q_nope[h] W_UK[h]) . c, so the query is moved
  into latent space once per token ("absorbed": q_lat[h] = q_nope[h] @ W_UK[h]) and the score of head h is
  [q_lat[h] | q_pe[h]] . [c | k_pe], one dot product over a row of `kv_lora_rank + qk_rope_head_dim`;
* values: softmax . v[h] = W_UV[h] (softmax . c), so attention over the same rows gives the latent
  output, and W_UV[h] then lifts it to the head's `v_head_dim` features before `o_proj`.
So attention is multi-query over one KV head whose K and V are the same row: the cache stores that row
once per token (the single-plane pool, `KVPool(shared_kv=True)`; the config reports 1 KV head of the row's
width, `ModelConfig.kv_shared`), and the backend's V reads land on the K rows. The output's last
`qk_rope_head_dim` features (softmax . k_pe) are dropped. The softmax scale is that of the unabsorbed
heads, (qk_nope + qk_rope) ** -0.5, with YaRN's mscale(factor, mscale_all_dim) squared under a scaled
rope (`ModelConfig.attn_scale`, given to the backend). A prefill/decode transfer moves only these rows.

Queries: `q_lora_rank` set: q_a_proj -> q_a_layernorm -> q_b_proj; unset: q_proj. Rope: the checkpoint's
rope features are interleaved pairs (x0, x1), (x2, x3), ... when `rope_interleave` (the default);
transformers rotates each pair and writes the results as [evens | odds], which is the rotate-half rope of
the de-interleaved vector, so we de-interleave q_pe and k_pe and rotate them as the Llama family does
(dot products only need q and k in the same order). `rope_scaling` default or YaRN (its inverse
frequencies and attention factor on cos / sin, `YarnRotary`).

Experts. The first `first_k_dense_replace` layers keep a dense MLP of `intermediate_size`; the others have
`n_routed_experts` experts of `moe_intermediate_size`: sigmoid scores, `e_score_correction_bias` added
only to choose (the best `topk_group` of `n_group` groups by their two best, then the top
`num_experts_per_tok`), the chosen experts' plain scores renormalised (`norm_topk_prob`) and scaled by
`routed_scaling_factor` (`common/layers/moe.py`'s `RoutingRule`). A shared expert of `n_shared_experts *
moe_intermediate_size` features, ungated, is added for every token.

Tensor parallelism: query heads split over the ranks (q_b_proj / q_proj rows and kv_b_proj rows by head,
o_proj row parallel); the latent projections are replicated, so every rank computes and caches the same
latent rows (1 KV head, replicated, as `ModelConfig.local_kv_heads` says). Routed experts split as in
`SparseMoE` (or over EP ranks with `ep_size`), the shared expert's features over TP, one all-reduce for
both. Not served: the checkpoint's MTP layers (`model.layers.<num_hidden_layers>.*`, skipped at load;
draft-layer speculation is refused by the loader), the native decoder stack, sliding windows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from common.distributed import tensor_model_parallel_all_reduce
from common.forward_batch import ForwardBatch
from common.layers.attention_backend import AttentionBackend
from common.layers.eplb import Eplb
from common.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, _copy_checked
from common.layers.moe import RoutingRule, SparseMoE, select_experts
from common.layers.norm import RMSNorm
from common.layers.rotary import RotaryEmbedding
from common.models.attention import attention_backend_for
from common.models.config import ModelConfig, ModelConfigError, yarn_mscale
from common.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, load_checkpoint
from common.models.pipeline import MissingLayer, layer_range
from common.models.qwen3_5_moe import SharedExpert

MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def yarn_inv_freq(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies for `dim` rotary features and its cos / sin factor: frequencies below the
    `beta_slow` .. `beta_fast` rotations (over the original context) interpolated by `factor`, those above
    kept, a linear ramp between."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep, float(attn)


class YarnRotary(RotaryEmbedding):
    """`RotaryEmbedding` with YaRN's frequencies, its attention factor folded into the cos / sin tables."""

    def __init__(self, dim: int, max_positions: int, base: float, scaling: dict, dtype: torch.dtype) -> None:
        self.inv_freq, self.factor = yarn_inv_freq(dim, base, scaling)
        self.head_dim, self.dtype = dim, dtype
        self._build(max(int(max_positions), 1))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.int64, device=self.inv_freq.device).float()
        freqs = torch.outer(t, self.inv_freq)
        self.cos_cache = (freqs.cos() * self.factor).to(self.dtype)
        self.sin_cache = (freqs.sin() * self.factor).to(self.dtype)


def mla_rotary(cfg: ModelConfig, dtype: torch.dtype) -> RotaryEmbedding:
    dim = int(cfg.raw["qk_rope_head_dim"])
    if cfg.rope_type == "yarn":
        return YarnRotary(dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling or {}, dtype)
    if cfg.rope_type != "default":
        raise ModelConfigError(f"{cfg.name}: rope_type {cfg.rope_type!r} is not supported for DeepSeek-V3 "
                               "(default, yarn)")
    return RotaryEmbedding(dim, cfg.context_length, cfg.rope_theta, dtype=dtype)


class HeadRows(nn.Module):
    """kv_b_proj's weight `[heads * (qk_nope + v), kv_lora_rank]`, this rank's heads' rows; never applied as a
    linear layer (its two parts are folded into the query and the output per head), so never packed."""

    def __init__(self, heads: int, rows_per_head: int, cols: int, tp_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows = heads * rows_per_head
        self.offset = tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, cols, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded.narrow(0, self.offset, self.rows), "kv_b_proj")


def replicated(inp: int, out: int, bias: bool, dtype: torch.dtype) -> ColumnParallelLinear:
    """A full linear layer on every rank, with an optional bias (ColumnParallelLinear over one rank)."""
    return ColumnParallelLinear(inp, out, bias, tp_rank=0, tp_size=1, dtype=dtype)


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend, tp_rank: int,
                 tp_size: int, tp_group, dtype: torch.dtype) -> None:
        super().__init__()
        raw = cfg.raw
        self.layer_id, self.backend = layer_id, backend
        self.lora, self.nope = int(raw["kv_lora_rank"]), int(raw["qk_nope_head_dim"])
        self.rope, self.v_dim = int(raw["qk_rope_head_dim"]), int(raw["v_head_dim"])
        self.interleaved = bool(raw.get("rope_interleave", True))
        qk = self.nope + self.rope
        self.heads = cfg.num_heads // tp_size
        bias = cfg.attention_bias
        q_lora = raw.get("q_lora_rank")
        tp = dict(tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        if q_lora:
            self.q_a_proj = replicated(cfg.hidden_size, int(q_lora), bias, dtype)
            self.q_a_layernorm = RMSNorm(int(q_lora), LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(int(q_lora), cfg.num_heads * qk, **tp)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * qk, **tp)
        self.kv_a_proj_with_mqa = replicated(cfg.hidden_size, self.lora + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.lora, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = HeadRows(self.heads, self.nope + self.v_dim, self.lora, tp_rank, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias, tp_group=tp_group,
                                        **tp)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # pairs (x0, x1), (x2, x3) ... -> [evens | odds], then rotate-half
            x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        return RotaryEmbedding.apply(x.contiguous(), cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        t, h, lora, nope = x.shape[0], self.heads, self.lora, self.nope
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, h, nope + self.rope)
        kv = self.kv_a_proj_with_mqa(x)
        latent = torch.empty(t, lora + self.rope, dtype=x.dtype, device=x.device)  # the cached row
        latent[:, :lora] = self.kv_a_layernorm(kv[:, :lora].contiguous())
        latent[:, lora:] = self._rotate(kv[:, lora:].view(t, 1, self.rope), cos, sin).view(t, self.rope)
        w = self.kv_b_proj.weight.view(h, nope + self.v_dim, lora)
        query = torch.empty(t, h, lora + self.rope, dtype=x.dtype, device=x.device)
        # q_lat[h] = q_nope[h] @ W_UK[h], all heads in one batched matmul ([h, t, nope] @ [h, nope, lora])
        query[..., :lora] = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)
        query[..., lora:] = self._rotate(q[..., nope:], cos, sin)
        o = self.backend.forward(query.view(t, -1), latent, latent, self.layer_id, fb)
        o = o.view(t, h, lora + self.rope)[..., :lora]
        # per head W_UV[h] (softmax . c): [h, t, lora] @ [h, lora, v]
        out = torch.bmm(o.transpose(0, 1), w[:, nope:].transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(t, h * self.v_dim))


class DeepseekMoE(SparseMoE):
    """Routed experts (sigmoid scores, a correction bias that steers the choice) plus the ungated shared
    expert; this rank's partial sums of both reduced over TP once."""

    def __init__(self, num_experts: int, hidden: int, inter: int, shared_inter: int, rule: RoutingRule, *,
                 tp_rank: int, tp_size: int, tp_group, dtype: torch.dtype, **ep) -> None:
        super().__init__(num_experts, hidden, inter, rule, tp_rank=tp_rank, tp_size=tp_size,
                         tp_group=tp_group, dtype=dtype, reduce=False, **ep)
        # `mlp.gate.e_score_correction_bias` in the checkpoint
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                         requires_grad=False)
        self.shared_experts = SharedExpert(hidden, shared_inter, tp_rank=tp_rank, tp_size=tp_size,
                                           tp_group=tp_group, dtype=dtype) if shared_inter else None

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(self.gate(x), self.rule, self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # not reduced
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out, self.tp_group)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """The Llama layer (norms, residuals, its forward) with latent attention."""

    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend, tp_rank: int,
                 tp_size: int, tp_group, dtype: torch.dtype, make_mlp) -> None:
        nn.Module.__init__(self)
        self.self_attn = MlaAttention(cfg, layer_id, backend, tp_rank, tp_size, tp_group, dtype)
        self.mlp = make_mlp(cfg, layer_id, tp_rank, tp_size, tp_group, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype, layers: tuple[int, int], make_mlp) -> None:
        super().__init__()
        start, end = layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, backend, tp_rank, tp_size, tp_group, dtype, make_mlp)
            if start <= i < end else MissingLayer() for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """See the module docstring. Forward, pipeline stages and final logits are the Llama model's."""

    decoder_stack = None  # the native decoder stack runs Llama layers only
    stacked_params = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))
    expert_parallel = True  # the loader's test for a model that takes ep_size / eplb

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, pp_rank: int = 0, pp_size: int = 1,
                 draft_layers: bool = False, attn_backend: AttentionBackend | None = None, ep_size: int = 1,
                 eplb=None) -> None:
        nn.Module.__init__(self)
        missing = [k for k in MLA_KEYS if not config.raw.get(k)]
        if missing or not config.kv_shared:
            raise ModelConfigError(f"{config.name}: a DeepSeek-V3 config needs "
                                   f"{', '.join(missing or MLA_KEYS)}")
        if draft_layers:
            raise ModelConfigError(f"{config.name}: DeepSeek-V3's MTP draft layers are not served")
        if config.hidden_act not in ("silu", "swish"):
            raise ModelConfigError(f"unsupported hidden_act {config.hidden_act!r} (supported: silu)")
        self.ep_size, self.eplb_settings = ep_size, eplb
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.layer_range = layer_range(config.num_layers, pp_rank, pp_size)
        self.micro_batches = 0
        self.attn_backend = attn_backend or attention_backend_for(config, "native", tp_size, windows=False)
        self.rotary = mla_rotary(config, dtype)
        self.model = DeepseekModel(config, self.attn_backend, tp_rank, tp_size, tp_group, dtype,
                                   self.layer_range, self.make_mlp)
        self.lm_head = None if config.tie_word_embeddings else \
            ReplicatedLinear(config.hidden_size, config.vocab_size, dtype=dtype)
        self.mtp = None

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype) -> nn.Module:
        raw = cfg.raw
        experts = int(raw.get("n_routed_experts") or 0)
        if not experts or layer_id < int(raw.get("first_k_dense_replace") or 0):
            return LlamaMLP(cfg, tp_rank, tp_size, tp_group, dtype)
        rule = RoutingRule(top_k=int(raw["num_experts_per_tok"]),
                           scoring=raw.get("scoring_func") or "sigmoid",
                           renormalize=bool(raw.get("norm_topk_prob", True)),
                           n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
                           routed_scaling=float(raw.get("routed_scaling_factor") or 1.0))
        inter = int(raw["moe_intermediate_size"])
        ep = {}
        if self.ep_size != 1:
            ep["ep_size"] = self.ep_size
        if self.eplb_settings is not None:
            s = self.eplb_settings
            ep["eplb"] = Eplb(s.interval, s.redundant_per_rank, layer_id)
        shared = int(raw.get("n_shared_experts") or 0) * inter
        if shared % tp_size:
            raise ModelConfigError(f"shared expert size {shared} does not split over TP size {tp_size}")
        return DeepseekMoE(experts, cfg.hidden_size, inter, shared, rule, tp_rank=tp_rank, tp_size=tp_size,
                           tp_group=tp_group, dtype=dtype, **ep)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # the MTP layers follow the decoder's as `model.layers.<num_hidden_layers>...`
        mtp = tuple(f"model.layers.{self.config.num_layers + i}." for i in
                    range(int(self.config.raw.get("num_nextn_predict_layers") or 0)))
        return load_checkpoint(self, weights, {"qkv_proj": 3, "gate_up_proj": 2}, skipped_prefixes=mtp)
