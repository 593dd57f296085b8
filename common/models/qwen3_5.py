"""Qwen3.5 dense text model: Gated DeltaNet linear-attention layers interleaved with gated full
attention (transformers' `Qwen3_5ForCausalLM`, or the text part of `Qwen3_5ForConditionalGeneration`).

Layers follow `layer_types` (`linear_attention` / `full_attention`):
* full attention: q_proj yields per head `[query | output gate]`, q/k RMSNorm, rotary embedding on
  the first `partial_rotary_factor * head_dim` dims, the paged attention backend the runner chose, then
  `o_proj(attn * sigmoid(gate))`. Only these layers have a KV cache (`config.kv_layer_ids`).
* linear attention (Gated DeltaNet): in_proj_qkv → causal depthwise conv1d (kernel K) → SiLU;
  per head L2-normalised q, k; `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`; the
  gated delta rule `S ← exp(g) S + k ⊗ beta (v - Sᵀk)`, `o = Sᵀq`; gated RMSNorm with SiLU(z); out_proj.
  Per request it keeps a conv state (the last K-1 conv inputs) and a recurrent state `S` in the
  model's `StatePool`, in the slot `fb.state_indices[i]`. An EXTEND with `extend_prefix_lens[i] > 0`
  continues from the stored state (chunked prefill: the state holds exactly the prefix), an EXTEND
  from position 0 starts from zero state; DECODE applies the one-step recurrence.
* RMSNorms of the decoder (input/post-attention/final, q/k norms) scale by `1 + weight`; the gated
  norm of the linear layers scales by `weight`.

Tensor parallelism: attention heads, linear-attention key heads (with their value heads) and the MLP
are split over ranks; o_proj/out_proj/down_proj are row parallel. The conv channels are stored
grouped per key head — `[q_h | k_h | v of the value heads of h]` for each key head h — so this rank's
channels, and its conv state, are one contiguous block whose leading dimension is the local key
heads: the transfer layer can slice conv and recurrent state along their leading dims (key heads and
value heads) between different TP sizes.

Use (common/hybrid.py): the runner builds `StatePool(rows, *model.state_spec().pool_args())`, attaches
it to the `ReqToTokenPool` (a row's state slot is taken and returned with the row) and calls
`model.bind_state_pool(pool)`; its forward sets `fb.state_indices` from the batch's rows. The radix
cache is off for this model (a cached KV prefix does not recover the recurrent state at that position).

Pipeline parallelism (`pp_rank` of `pp_size`, common/models/pipeline.py): a stage holds its
`layer_range` of layers, so its KV pool holds the full-attention layers in that range (possibly none)
and its state pool the linear-attention layers in it (possibly none: `state_spec()` is None).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.attention_backend import AttentionBackend
from common.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from common.layers.norm import default_weight_loader
from common.layers.rotary import RotaryEmbedding
from common.memory.state_pool import StatePool
from common.models.attention import attention_backend_for
from common.models.config import ModelConfig, ModelConfigError
from common.models.llama import LlamaForCausalLM, dense_mlp, final_logits, load_checkpoint
from common.models.mtp import MtpHead
from common.models.pipeline import MissingLayer, forward_stage, layer_range

logger = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class StateSpec:
    """What one TP rank's state pool holds per linear-attention layer and slot."""
    layer_ids: list[int]
    conv_shape: tuple[int, int, int]  # [local key heads, channels per key head, kernel - 1]
    recurrent_shape: tuple[int, int, int]  # [local value heads, key head dim, value head dim]

    def pool_args(self) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
        return self.layer_ids, self.conv_shape, self.recurrent_shape


def layer_types_of(cfg: ModelConfig) -> list[str]:
    raw = cfg.raw
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(cfg.num_layers)]
    types = list(types)
    if len(types) != cfg.num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ModelConfigError(f"layer_types must list {cfg.num_layers} entries of {LINEAR!r}/{FULL!r}, "
                               f"got {types}")
    return types


def _rope_params(cfg: ModelConfig) -> tuple[float, float]:
    raw = cfg.raw
    rp = raw.get("rope_parameters") or {}
    factor = rp.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    theta = rp.get("rope_theta", raw.get("rope_theta", cfg.rope_theta))
    return float(factor), float(theta)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by `1 + weight` (weights stored zero-centred), with a fused residual add."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk: int = 64
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, `chunk` tokens at a time (WY form within a chunk).

    q, k `[H, n, dk]` (q already scaled, both L2-normalised), v `[H, n, dv]`, g (log decay) and beta
    `[H, n]`, state `[H, dk, dv]` → output `[H, n, dv]` in v's dtype and the state after the last token
    in float32: the rule runs in float32 whatever the model's dtype (in bfloat16 the decays and the
    triangular solve lose the state within a few chunks, and the inputs' dtypes differ: g is float32).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    h, n, dk = k.shape
    dv = v.shape[-1]
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    nc = (n + pad) // chunk
    q = q.reshape(h, nc, chunk, dk)
    k = k.reshape(h, nc, chunk, dk)
    v = v.reshape(h, nc, chunk, dv)
    gc = g.reshape(h, nc, chunk).cumsum(-1)  # log decay from the chunk start to each token
    beta = beta.reshape(h, nc, chunk, 1)
    k_beta = k * beta
    # decay between token j and token i (j <= i) of one chunk; zero above the diagonal
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    # (I + strictly-lower(beta_i k_i·k_j decay_ij)) u = beta v, w likewise for the decayed keys
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system + eye, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system + eye, k_beta * gc.exp().unsqueeze(-1), upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gc.exp().unsqueeze(-1)
    k_dec = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()
    out = torch.empty(h, nc, chunk, dv, dtype=q.dtype, device=q.device)
    s = state.float()
    for c in range(nc):
        v_new = u[:, c] - w[:, c] @ s
        out[:, c] = q_dec[:, c] @ s + intra[:, c] @ v_new
        s = s * chunk_decay[:, c, None, None] + k_dec[:, c].transpose(-1, -2) @ v_new
    return out.reshape(h, nc * chunk, dv)[:, :n].to(out_dtype), s


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k `[B, H, dk]`, v `[B, H, dv]`, g, beta `[B, H]`, state
    `[B, H, dk, dv]` → output `[B, H, dv]` in v's dtype, new state in float32 (as the chunked rule)."""
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state.float() * g.exp()[..., None, None]
    predicted = (s * k.unsqueeze(-1)).sum(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(-2).to(out_dtype), s


class _GroupedConvChannels:
    """Maps the checkpoint's conv channel order `[q heads | k heads | v heads]` to this rank's
    grouped order: for each local key head h, `[q_h | k_h | v heads of h]`."""

    def __init__(self, nk: int, nv: int, dk: int, dv: int, tp_rank: int, tp_size: int) -> None:
        ratio = nv // nk
        local_k = nk // tp_size
        key_dim = nk * dk
        rows = []
        for j in range(local_k):
            hk = tp_rank * local_k + j
            rows.append(torch.arange(hk * dk, (hk + 1) * dk, device="cpu"))
            rows.append(torch.arange(key_dim + hk * dk, key_dim + (hk + 1) * dk, device="cpu"))
            rows.append(torch.arange(2 * key_dim + hk * ratio * dv,
                                     2 * key_dim + (hk + 1) * ratio * dv, device="cpu"))
        self.index = torch.cat(rows)

    def loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        src = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded  # conv1d [C, 1, K]
        if self.index.numel() and int(self.index.max()) >= src.shape[0]:
            raise ValueError(f"checkpoint tensor has {src.shape[0]} rows, the model needs more")
        part = src.index_select(0, self.index)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint slice has shape {tuple(part.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        param.data.copy_(part.to(param.dtype))


def _head_slice_loader(local: int, tp_rank: int):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded.narrow(0, tp_rank * local, local)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint slice has shape {tuple(part.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        param.data.copy_(part.to(param.dtype))
    return load


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype) -> None:
        super().__init__()
        raw = cfg.raw
        self.layer_id = layer_id
        nk = int(raw.get("linear_num_key_heads", 16))
        nv = int(raw.get("linear_num_value_heads", 32))
        dk = int(raw.get("linear_key_head_dim", 128))
        dv = int(raw.get("linear_value_head_dim", 128))
        kernel = int(raw.get("linear_conv_kernel_dim", 4))
        if nv % nk:
            raise ModelConfigError(f"linear_num_value_heads ({nv}) must be a multiple of "
                                   f"linear_num_key_heads ({nk})")
        if nk % tp_size:
            raise ModelConfigError(f"{nk} linear-attention key heads do not split over TP size {tp_size}")
        if kernel < 2:
            raise ModelConfigError(f"linear_conv_kernel_dim must be at least 2, got {kernel}")
        self.dk, self.dv, self.kernel = dk, dv, kernel
        self.ratio = nv // nk
        self.local_k = nk // tp_size
        self.local_v = nv // tp_size
        self.group_channels = 2 * dk + self.ratio * dv
        conv_local = self.local_k * self.group_channels
        channels = _GroupedConvChannels(nk, nv, dk, dv, tp_rank, tp_size)

        self.in_proj_qkv = ColumnParallelLinear(cfg.hidden_size, conv_local * tp_size, tp_rank=tp_rank,
                                                tp_size=tp_size, dtype=dtype)
        self.in_proj_qkv.weight.weight_loader = channels.loader
        self.in_proj_zba = MergedColumnParallelLinear(cfg.hidden_size, [nv * dv, nv, nv], tp_rank=tp_rank,
                                                      tp_size=tp_size, dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(conv_local, kernel, dtype=dtype), requires_grad=False)
        self.conv1d.weight.weight_loader = channels.loader
        self.A_log = nn.Parameter(torch.empty(self.local_v, dtype=dtype), requires_grad=False)
        self.A_log.weight_loader = _head_slice_loader(self.local_v, tp_rank)
        self.dt_bias = nn.Parameter(torch.empty(self.local_v, dtype=dtype), requires_grad=False)
        self.dt_bias.weight_loader = _head_slice_loader(self.local_v, tp_rank)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv, dtype=dtype), requires_grad=False)
        self.norm.weight.weight_loader = default_weight_loader
        self.norm_eps = cfg.rms_norm_eps
        self.out_proj = RowParallelLinear(nv * dv, cfg.hidden_size, tp_rank=tp_rank, tp_size=tp_size,
                                          tp_group=tp_group, dtype=dtype)

    @property
    def conv_shape(self) -> tuple[int, int, int]:
        return (self.local_k, self.group_channels, self.kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.local_v, self.dk, self.dv)

    def _split_heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output `[..., local_k * group_channels]` → q, k `[..., local_v, dk]` (each key head
        repeated for its value heads, normalised, q scaled) and v `[..., local_v, dv]`."""
        lead = y.shape[:-1]
        y = y.reshape(*lead, self.local_k, self.group_channels)
        dk = self.dk
        q = _l2norm(y[..., :dk]).repeat_interleave(self.ratio, dim=-2) * dk ** -0.5
        k = _l2norm(y[..., dk:2 * dk]).repeat_interleave(self.ratio, dim=-2)
        v = y[..., 2 * dk:].reshape(*lead, self.local_v, self.dv)
        return q, k, v

    def _step(self, prev: torch.Tensor, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per sequence: the conv window `prev` ([B, C, K - 1]) and recurrent `state` advanced
        over `mixed` ([B, C]); returns the output [B, heads, dv], the new window and the new state."""
        window = torch.cat([prev, mixed.unsqueeze(-1)], dim=-1)  # [B, C, K]
        y = F.silu((window * self.conv1d.weight).sum(-1))
        q, k, v = self._split_heads(y)
        o, s = recurrent_gated_delta_step(q, k, v, g, beta, state)
        return o, window[..., 1:], s

    def _verify(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, fb: ForwardBatch,
                conv_buf: torch.Tensor, rec_buf: torch.Tensor) -> torch.Tensor:
        """A speculative verify batch: each request's tokens (its last one and its drafts) advance its
        state one at a time, with the decode step's own operations, so every output equals what decode
        steps would give. The slot is left as it was; the state after each token goes to
        `fb.extras["verify_states"][layer_id]` (`[B, tokens, ...]` conv windows and recurrent states),
        and `HybridSupport.keep_verified` writes the one after the last confirmed token."""
        lens = list(fb.extend_seq_lens)
        b, most = len(lens), max(lens)
        starts = torch.tensor([0, *lens[:-1]], dtype=torch.int64, device=mixed.device).cumsum(0)
        # copies: the slots stay as they are
        conv0 = conv_buf[fb.state_indices].reshape(b, -1, self.kernel - 1)
        rec0 = rec_buf[fb.state_indices]
        conv_steps = conv0.new_empty(b, most, *conv0.shape[1:])
        rec_steps = rec0.new_empty(b, most, *rec0.shape[1:])
        o = torch.empty(mixed.shape[0], self.local_v, self.dv, dtype=mixed.dtype, device=mixed.device)
        for j in range(most):
            live = torch.tensor([i for i in range(b) if lens[i] > j], dtype=torch.int64, device=mixed.device)
            rows = starts[live] + j
            conv, rec = (conv0[live], rec0[live]) if j == 0 \
                else (conv_steps[live, j - 1], rec_steps[live, j - 1])
            o[rows], conv_steps[live, j], rec_steps[live, j] = self._step(conv, mixed[rows],
                                                                          g[rows], beta[rows], rec)
        fb.extras.setdefault("verify_states", {})[self.layer_id] = (conv_steps, rec_steps)
        return o

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: StatePool) -> torch.Tensor:
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, C]
        z, b, a = self.in_proj_zba(x).split([self.local_v * self.dv, self.local_v, self.local_v], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, local_v]
        conv_buf = pool.conv(self.layer_id)
        rec_buf = pool.recurrent(self.layer_id)
        weight = self.conv1d.weight  # [C, K]
        channels = weight.shape[0]
        keep = self.kernel - 1
        if fb.state_indices is None:
            raise ValueError("a hybrid model's forward needs fb.state_indices (one state slot per request)")
        slots = fb.state_indices

        if fb.mode == ForwardMode.DECODE:
            prev = conv_buf[slots].reshape(t, channels, keep)
            o, conv, s = self._step(prev, mixed, g, beta, rec_buf[slots])
            conv_buf[slots] = conv.reshape(t, *self.conv_shape)
            rec_buf[slots] = s.to(rec_buf.dtype)
        elif fb.mode == ForwardMode.VERIFY:
            o = self._verify(mixed, g, beta, fb, conv_buf, rec_buf)
        else:
            o = torch.empty(t, self.local_v, self.dv, dtype=x.dtype, device=x.device)
            start = 0
            for i, (n, p) in enumerate(zip(fb.extend_seq_lens, fb.extend_prefix_lens, strict=True)):
                slot = int(slots[i])
                xs = mixed[start:start + n].transpose(0, 1)  # [C, n]
                if p > 0:
                    prev = conv_buf[slot].reshape(channels, keep)
                    s0 = rec_buf[slot]
                else:
                    prev = xs.new_zeros(channels, keep)
                    s0 = rec_buf.new_zeros(self.recurrent_shape)
                full = torch.cat([prev, xs], dim=1)  # [C, K - 1 + n]
                conv_buf[slot] = full[:, -keep:].reshape(self.conv_shape)
                y = F.silu(F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=channels)[0])  # [C, n]
                q, k, v = self._split_heads(y.transpose(0, 1))  # [n, H, d]
                oi, s = chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               g[start:start + n].transpose(0, 1),
                                               beta[start:start + n].transpose(0, 1), s0)
                rec_buf[slot] = s.to(rec_buf.dtype)
                o[start:start + n] = oi.transpose(0, 1)
                start += n

        # gated RMSNorm per value head: weight * norm(o) * silu(z)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        of = self.norm.weight * of.to(x.dtype)
        of = of * F.silu(z.reshape(t, self.local_v, self.dv).float())
        return self.out_proj(of.to(x.dtype).reshape(t, self.local_v * self.dv))


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, backend: AttentionBackend, rotary_dim: int,
                 tp_rank: int, tp_size: int, tp_group, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        d = cfg.head_dim
        # q_proj rows are per head [query (d) | gate (d)]: as 2H heads of d, a rank's share is contiguous
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.rotary_dim = rotary_dim
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size,
                                        cfg.attention_bias, tp_rank=tp_rank,
                                        tp_size=tp_size, tp_group=tp_group, dtype=dtype)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps, dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        if rd == x.shape[-1]:
            return RotaryEmbedding.apply(x, cos, sin)
        return torch.cat([RotaryEmbedding.apply(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        nh, d = self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * nh * d, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(t, nh, 2, d)
        q = self._rope(self.q_norm(qg[:, :, 0]), cos, sin)
        gate = qg[:, :, 1].reshape(t, nh * d)
        k = self._rope(self.k_norm(k.view(t, self.num_kv_heads, d)), cos, sin)
        o = self.backend.forward(q.reshape(t, nh * d), k.reshape(t, self.kv_size), v, self.layer_id, fb)
        return self.o_proj(o * torch.sigmoid(gate))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, layer_type: str, backend: AttentionBackend,
                 rotary_dim: int, tp_rank: int, tp_size: int, tp_group, dtype: torch.dtype,
                 make_mlp=dense_mlp) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, layer_id, tp_rank, tp_size, tp_group, dtype)
        else:
            self.self_attn = GatedAttention(cfg, layer_id, backend, rotary_dim, tp_rank,
                                            tp_size, tp_group, dtype)
        self.mlp = make_mlp(cfg, layer_id, tp_rank, tp_size, tp_group, dtype)  # sparse: qwen3_5_moe.py
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, pool: StatePool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, fb, pool)
        else:
            h = self.self_attn(h, cos, sin, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3_5TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, types: list[str], backend: AttentionBackend, rotary_dim: int,
                 tp_rank: int, tp_size: int, tp_group, dtype: torch.dtype, layers: tuple[int, int],
                 make_mlp=dense_mlp) -> None:
        super().__init__()
        # no random init: every weight comes from the checkpoint (the loader refuses a missing one)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = default_weight_loader
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(cfg, i, types[i], backend, rotary_dim, tp_rank, tp_size, tp_group, dtype,
                                make_mlp) if layers[0] <= i < layers[1] else MissingLayer()
            for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Qwen3_5ForCausalLM(nn.Module):
    """See the module docstring. Sets `config.kv_layer_ids` to the full-attention layers."""

    is_hybrid = True
    make_mlp = staticmethod(dense_mlp)  # each layer's MLP (a sparse block in Qwen3.5-MoE)
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params = LlamaForCausalLM.stacked_params + (
        (".in_proj_z.", ".in_proj_zba.", 0),
        (".in_proj_b.", ".in_proj_zba.", 1),
        (".in_proj_a.", ".in_proj_zba.", 2),
    )
    # checkpoint prefixes of parts that a text-only server does not use
    skipped_prefixes = ("model.visual.", "visual.", "mtp.", "model.mtp.")

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, pp_rank: int = 0, pp_size: int = 1,
                 draft_layers: bool = False, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.layer_range = start, end = layer_range(config.num_layers, pp_rank, pp_size)
        self.micro_batches = 0  # run by pipelined forwards (in forwards cut into more than one)
        self.layer_types = layer_types_of(config)
        config.kv_layer_ids = [i for i, t in enumerate(self.layer_types) if t == FULL]
        # this stage's linear-attention layers (all of them without pipeline stages)
        self.linear_layer_ids = [i for i, t in enumerate(self.layer_types)
                                 if t == LINEAR and start <= i < end]
        factor, theta = _rope_params(config)
        rotary_dim = int(config.head_dim * factor)
        if rotary_dim % 2 or rotary_dim <= 0:
            raise ModelConfigError(f"partial_rotary_factor {factor} of head_dim {config.head_dim} gives an "
                                   f"unusable rotary dimension {rotary_dim}")
        # the runner's choice (--attention-backend); the CPU's native kernels for a model built on its own
        self.attn_backend = attn_backend or attention_backend_for(config, "native", tp_size, windows=False)
        self.rotary = RotaryEmbedding(rotary_dim, config.context_length, theta, dtype=dtype)
        self.model = Qwen3_5TextModel(config, self.layer_types, self.attn_backend,
                                      rotary_dim, tp_rank, tp_size, tp_group, dtype, self.layer_range,
                                      self.make_mlp)
        self.lm_head = None if config.tie_word_embeddings else ReplicatedLinear(config.hidden_size,
                                                                                config.vocab_size,
                                                                                dtype=dtype)
        self.state_pool: StatePool | None = None
        # the checkpoint's draft layers (`mtp.*`: a gated full-attention layer, id num_layers) for EAGLE / MTP
        self.mtp = None
        if draft_layers:
            layer = Qwen3_5DecoderLayer(config, config.num_layers, FULL, self.attn_backend, rotary_dim,
                                        tp_rank, tp_size, tp_group, dtype, self.make_mlp)
            self.mtp = MtpHead(config, layer, dtype, norm=OffsetRMSNorm)
            self.skipped_prefixes = tuple(p for p in self.skipped_prefixes if "mtp." not in p)

    # ------------------------------------------------------------------ state
    def state_spec(self) -> StateSpec | None:
        """The state pool this model (this pipeline stage) needs; None when it has no linear-attention
        layer."""
        if not self.linear_layer_ids:
            return None
        first = self.model.layers[self.linear_layer_ids[0]].linear_attn
        return StateSpec(list(self.linear_layer_ids), first.conv_shape, first.recurrent_shape)

    def bind_state_pool(self, pool: StatePool) -> None:
        spec = self.state_spec()
        if pool.layer_ids != spec.layer_ids or pool.conv_shape != spec.conv_shape \
                or pool.recurrent_shape != spec.recurrent_shape:
            raise ValueError(f"state pool layout {pool.layer_ids} {pool.conv_shape} {pool.recurrent_shape} "
                             f"does not fit the model's {spec}")
        self.state_pool = pool

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.linear_layer_ids and self.state_pool is None:
            raise RuntimeError("Qwen3.5 needs a state pool: call bind_state_pool() first")
        if self.pp_size > 1:
            return forward_stage(self, fb, self._run_layers, final_logits)
        if fb.attn_metadata is None:
            self.attn_backend.init_forward_metadata(fb)
        h = F.embedding(fb.input_ids, self.model.embed_tokens.weight)
        cos, sin = self.rotary.cos_sin(fb.positions)
        h, residual = self._run_layers(h, None, cos, sin, fb)
        return final_logits(self, h, residual, fb)

    def _run_layers(self, h: torch.Tensor, residual: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor,
                    fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.layer_range
        for layer in self.model.layers[start:end]:
            h, residual = layer(h, residual, cos, sin, fb, self.state_pool)
        return h, residual

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, {"qkv_proj": 3, "gate_up_proj": 2, "in_proj_zba": 3},
                               rename=_language_model_name, skipped_prefixes=self.skipped_prefixes)


def _language_model_name(name: str) -> str:
    """A multimodal checkpoint's text weights under their text-only names."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    return name


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The multimodal checkpoint served text-only (its `text_config`, `model.language_model.*` weights)."""
