"""Tiny random-weight models for benches and tests that exercise serving, not the model.

`build_tiny_model(out_dir, arch, tokenizer_dir, overrides)` saves a Hugging Face model (hidden 64,
4 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128, 2048 positions) with seeded random fp32
weights and the tokenizer's vocabulary and files, so real text works; with `mtp_num_hidden_layers=1`
also random draft layers (`mtp.*`, for EAGLE / MTP speculation); with `gguf_blocks=True` its weights
are rounded as a Q4_1 GGUF file's (`gguf_round_trip`: Q4_1 projections, Q8_0 embedding and lm_head).
`tiny_model_dir()` builds one over the default model's tokenizer once per machine, in
`${PDSERVE_CACHE:-~/.cache/pdserve}/tiny-*`, and returns its directory (the chaos bench's default model).
`tests/conftest.py` builds its `make_tiny_model` fixture on the same function. It lives here, not in bench/,
because both the benches and the tests use it and the tests import nothing from bench/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt")

TINY_BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    tie_word_embeddings=False,
)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
# mixture-of-experts models: 4 experts of 32 features (Mixtral's: of `intermediate_size`), 2 per token
MOE_BASE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True),
            "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
            # Qwen3.5-MoE: linear-attention (Gated DeltaNet) layers around one full-attention layer, and a
            # shared expert of 48 features beside the routed ones
            "qwen3_5_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, linear_conv_kernel_dim=4,
                                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                linear_num_value_heads=4,
                                layer_types=["linear_attention", "linear_attention", "full_attention",
                                             "linear_attention"]),
            # DeepSeek-V3: latent attention (q through a rank-32 bottleneck, a 32 + 8 latent row per token), a
            # dense first layer, then sigmoid-routed top-2 of 8 experts in 2 groups (1 searched), a shared
            # expert, weights scaled by 2.5; the router's correction bias is seeded random (`routing_bias`)
            "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, q_lora_rank=32,
                                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=32,
                                routed_scaling_factor=2.5, norm_topk_prob=True, routing_bias=0.05)}


def build_tiny_model(out_dir: str, arch: str, tokenizer_dir: str, overrides: dict | None = None) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer

    if arch not in ARCHS:
        raise ValueError(f"tiny model: unknown arch {arch!r} (one of {', '.join(ARCHS)})")
    config_name, model_name = ARCHS[arch]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    kw = dict(TINY_BASE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    kw.update(MOE_BASE.get(arch, {}))
    kw.update(overrides or {})
    gguf_blocks = kw.pop("gguf_blocks", False)
    routing_bias = kw.pop("routing_bias", 0.0)  # spread of a random e_score_correction_bias (DeepSeek-V3)
    config = getattr(transformers, config_name)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    if routing_bias:  # transformers starts the bias at zero; a random one steers the choice of experts
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(routing_bias * torch.randn(b.shape, generator=gen))
    if gguf_blocks:  # as a Q4_1 GGUF file converts: projections Q4_1, the embedding and lm_head Q8_0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.copy_(gguf_round_trip(p, 8 if "embed" in name or "lm_head" in name else 4))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    if kw.get("mtp_num_hidden_layers"):
        add_draft_layers(out_dir, model.state_dict(), kw["hidden_size"])
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, name))


def gguf_round_trip(weight, bits: int):
    """`weight` ([out, in], in a multiple of 32) quantized as GGUF's Q4_1 (bits 4: per 32 inputs d and m in
    float16, q in 0..15) or Q8_0 (bits 8: d in float16, q in -127..127), then dequantized to float32 as the
    conversion to a Hugging Face directory does (w = d * q + m)."""
    import torch

    out, inp = weight.shape
    v = weight.detach().to(torch.float32).reshape(out, inp // 32, 32)
    if bits == 4:
        m = v.amin(-1, keepdim=True).half().float()
        d = ((v.amax(-1, keepdim=True) - m) / 15).half().float()
        lo, hi = 0, 15
    else:
        m = torch.zeros_like(v[..., :1])
        d = (v.abs().amax(-1, keepdim=True) / 127).half().float()
        lo, hi = -127, 127
    q = torch.round((v - m) / torch.where(d > 0, d, torch.ones_like(d))).clamp_(lo, hi) + 0.0  # no -0.0
    return (d * q + m).reshape(out, inp)


def add_draft_layers(out_dir: str, state: dict, hidden: int) -> None:
    """Seeded random `mtp.*` draft layers (`random_draft_head`) next to the model's weights."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update(random_draft_head(state, hidden, seed=1))
    save_file(tensors, path, metadata={"format": "pt"})


def _layer0(weights: dict) -> dict:
    return {k[len("model.layers.0."):]: v for k, v in weights.items() if k.startswith("model.layers.0.")}


def _unit_norms(hidden: int, names=("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")) -> dict:
    import torch

    return {f"mtp.{n}.weight": torch.ones(hidden) for n in names}


def random_draft_head(weights: dict, hidden: int, seed: int) -> dict:
    """Seeded random `mtp.*` draft layers (common/models/mtp.py) for a checkpoint's tensors (HF names):
    layer 0's tensors with noise as the draft decoder layer, a random `fc`, unit norms. Their drafts are
    almost never the target's tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    head = {f"mtp.layers.0.{k}": (v + 0.02 * torch.randn(v.shape, generator=gen)
                                  if v.dim() > 1 else v.clone())
            .contiguous() for k, v in _layer0(weights).items()}
    head["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=gen)
    return {**head, **_unit_norms(hidden)}


def exact_draft_head(weights: dict, hidden: int, draft_attention: float = 0.0) -> dict:
    """Zero every layer's output projections in `weights` (in place: the target then predicts the next
    token from the current one alone) and return `mtp.*` draft layers that compute the same function of
    their input token (the layer adds nothing, `fc` passes the embedding through, the target's final
    norm), so every draft is the target's token. `draft_attention` scales layer 0's attention output back
    into the draft layer: its drafts then depend on its KV, and some are wrong."""
    import torch

    layer0 = _layer0(weights)
    for k in [k for k in weights
              if k.startswith("model.") and k.endswith(("o_proj.weight", "down_proj.weight"))]:
        weights[k] = torch.zeros_like(weights[k])
    head = {f"mtp.layers.0.{k}": v.clone() for k, v in layer0.items()}
    head["mtp.layers.0.self_attn.o_proj.weight"] = layer0["self_attn.o_proj.weight"] * draft_attention
    head["mtp.layers.0.mlp.down_proj.weight"] = torch.zeros_like(layer0["mlp.down_proj.weight"])
    head["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    head["mtp.norm.weight"] = weights["model.norm.weight"].clone()
    return {**head, **_unit_norms(hidden, ("pre_fc_norm_embedding", "pre_fc_norm_hidden"))}


def tiny_model_dir(arch: str = "llama", **overrides) -> str:
    """A tiny model over the default model's tokenizer, built once per machine and reused."""
    from common.models.default_model import cache_root, resolve_model_path

    cache = cache_root()
    key = hashlib.sha256(json.dumps([arch, overrides, TINY_BASE], sort_keys=True, default=str).encode())
    out = os.path.join(cache, f"tiny-{arch}-{key.hexdigest()[:12]}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=cache)
    try:
        build_tiny_model(tmp, arch, resolve_model_path("default"), overrides)
        try:
            os.rename(tmp, out)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
