"""ModelConfig: what the engine needs from a Hugging Face `config.json` (+ `generation_config.json`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """The model directory's config cannot be served (the message says why)."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _latent_attention(cfg: dict[str, Any], rope_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The cache shape and softmax scale of multi-head latent attention: a row of `kv_lora_rank +
    qk_rope_head_dim` per token, attention scaled by the full q/k head size (`qk_nope_head_dim +
    qk_rope_head_dim`) ** -0.5, times mscale(factor, mscale_all_dim) squared under a scaled rope."""
    rope_dim = int(cfg.get("qk_rope_head_dim") or 0)
    scale = (int(cfg.get("qk_nope_head_dim") or 0) + rope_dim) ** -0.5
    if rope_type != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return {"row_dim": int(cfg["kv_lora_rank"]) + rope_dim, "kv_shared": True, "attn_scale": scale}


def _as_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(i) for i in x]
    return [int(x)]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    eos_token_ids: list[int]
    name: str
    model_type: str = "llama"
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v and o (Llama-style `attention_bias`)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # layer ids that keep a KV cache (all, for dense models; hybrid models list their attention layers)
    kv_layer_ids: list[int] = field(default_factory=list)
    # multi-head latent attention (DeepSeek-V3, a config with `kv_lora_rank`): the cache keeps one row per
    # token, [compressed latent | roped shared key], read as both K and V (a single-plane pool), so
    # num_kv_heads is 1 and head_dim that row's width; attn_scale is the softmax scale (None: the
    # backend's head_dim ** -0.5)
    kv_shared: bool = False
    attn_scale: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def local_kv_heads(self, tp_size: int) -> int:
        """KV heads one TP rank holds (at least 1: KV heads are replicated when fewer than ranks)."""
        if self.num_heads % tp_size:
            raise ModelConfigError(f"{self.num_heads} attention heads do not split over TP size {tp_size}")
        if self.num_kv_heads >= tp_size:
            if self.num_kv_heads % tp_size:
                raise ModelConfigError(f"{self.num_kv_heads} KV heads do not split over TP size {tp_size}")
            return self.num_kv_heads // tp_size
        if tp_size % self.num_kv_heads:
            raise ModelConfigError(f"TP size {tp_size} is not a multiple of the {self.num_kv_heads} KV heads")
        return 1

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "raw"}
        return d

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "model",
                  generation_config: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelConfigError("config.json has no 'architectures' entry; cannot tell which "
                                   "model this is")
        if "text_config" in cfg and "hidden_size" not in cfg:
            inner = dict(cfg["text_config"])
            inner.setdefault("architectures", archs)
            cfg = inner
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ModelConfigError(f"config.json lacks {key!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # rope: transformers 5 writes `rope_parameters` (with rope_theta inside); older configs
        # have `rope_theta` and `rope_scaling`
        rope = dict(cfg.get("rope_scaling") or {})
        rp = cfg.get("rope_parameters") or {}
        if isinstance(rp, dict) and "rope_type" not in rp and all(isinstance(v, dict) for v in rp.values()):
            rp = rp.get("full_attention", {})  # per-layer-type form: the full attention layers'
        rope.update(rp)
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        eos = _as_list(cfg.get("eos_token_id"))
        for t in _as_list((generation_config or {}).get("eos_token_id")):
            if t not in eos:
                eos.append(t)
        sliding = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            sliding = None
        num_layers = int(cfg["num_hidden_layers"])
        ctx = int(cfg.get("max_position_embeddings") or 2048)
        model_type = str(cfg.get("model_type", "llama"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        mla = {}
        if cfg.get("kv_lora_rank"):  # one latent row per token is the cache's only KV head
            mla = _latent_attention(cfg, rope_type, rope)
            kv_heads, head_dim = 1, mla.pop("row_dim")
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            context_length=ctx,
            eos_token_ids=eos,
            name=name,
            model_type=model_type,
            intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope if rope_type != "default" else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            kv_layer_ids=list(range(num_layers)),
            raw=cfg,
            **mla,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ModelConfigError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
        with open(path) as f:
            cfg = json.load(f)
        gen = None
        gpath = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gpath):
            with open(gpath) as f:
                gen = json.load(f)
        name = os.path.basename(os.path.normpath(model_dir))
        return cls.from_dict(cfg, name=name, generation_config=gen)
