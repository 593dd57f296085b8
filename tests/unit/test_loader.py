"""Loader: architecture registry errors, missing weights and sharded checkpoints. TP-2 slicing across two
real gloo processes: tests/integration/test_loader_tp.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models.config import ModelConfig
from common.models.loader import ModelLoadError, UnsupportedArchitecture, load_model
from tests.model_harness import (
    one_torch_thread,  # noqa: F401  (autouse)
    teacher_forced_logits,
)


def _copy_model(src: str, dst: str, with_weights: bool = True) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if with_weights or not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, str(tmp_path / "m"))
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FancyNewForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedArchitecture, match="FancyNewForCausalLM") as ei:
        load_model(d)
    assert "LlamaForCausalLM" in str(ei.value)  # lists what is supported


def test_missing_weight_is_named(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, str(tmp_path / "m"), with_weights=False)
    sd = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    del sd["model.layers.2.mlp.up_proj.weight"]
    save_file(sd, os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.gate_up_proj\.weight"):
        load_model(d)


def test_no_weights_and_no_config(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, str(tmp_path / "m"), with_weights=False)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(d)
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_misshapen_weight(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, str(tmp_path / "m"), with_weights=False)
    sd = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(sd, os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="o_proj"):
        load_model(d)


def test_sharded_checkpoint_with_index(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    d = _copy_model(tiny_model_dir, str(tmp_path / "m"), with_weights=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.save_pretrained(d, safe_serialization=True, max_shard_size="2MB")
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    ids = list(range(10, 30))
    a = teacher_forced_logits(*load_model(d), ids, prefill=16)
    b = teacher_forced_logits(*load_model(tiny_model_dir), ids, prefill=16)
    assert torch.equal(a, b)


def test_config_fields(make_tiny_model):
    cfg = ModelConfig.from_pretrained(make_tiny_model("qwen2"))
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("Qwen2ForCausalLM", 4, 4, 2, 16)
    assert cfg.qkv_bias and not cfg.attention_bias
    assert cfg.eos_token_ids == [2] and cfg.context_length == 2048 and cfg.vocab_size == 49152
    assert cfg.local_kv_heads(1) == 2 and cfg.local_kv_heads(2) == 1 and cfg.local_kv_heads(4) == 1
    with pytest.raises(ValueError, match="TP size 3"):
        cfg.local_kv_heads(3)
