"""Tiny random-weight models for benches and tests that exercise serving, not the model.

`build_tiny_model(out_dir, arch, tokenizer_dir, overrides)` saves a Hugging Face model (hidden 64,
4 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128, 2048 positions) with seeded random fp32
weights and the tokenizer's vocabulary and files, so real text works; with `mtp_num_hidden_layers=1`
also random draft layers (`mtp.*`, for EAGLE / MTP speculation). `tiny_model_dir()` builds one
over the default model's tokenizer once per machine, in `${PDSERVE_CACHE:-~/.cache/pdserve}/tiny-*`,
and returns its directory (the chaos bench's default model). `tests/conftest.py` builds its
`make_tiny_model` fixture on the same function.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt")

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
}


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
    kw.update(overrides or {})
    config = getattr(transformers, config_name)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    if kw.get("mtp_num_hidden_layers"):
        add_draft_layers(out_dir, model.state_dict(), kw["hidden_size"])
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, name))


def add_draft_layers(out_dir: str, state: dict, hidden: int) -> None:
    """Seeded random `mtp.*` draft layers (common/models/mtp.py) next to the model's weights: layer 0's
    tensors with noise as the draft decoder layer, a random `fc`, unit norms."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in state.items():
        if name.startswith("model.layers.0."):
            noise = 0.02 * torch.randn(t.shape, generator=gen) if t.dim() > 1 else 0
            tensors["mtp.layers.0." + name[len("model.layers.0."):]] = (t + noise).contiguous()
    tensors["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.ones(hidden)
    save_file(tensors, path, metadata={"format": "pt"})


def tiny_model_dir(arch: str = "llama", **overrides) -> str:
    """A tiny model over the default model's tokenizer, built once per machine and reused."""
    from common.models.default_model import resolve_model_path

    cache = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
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
