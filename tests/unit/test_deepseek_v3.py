"""DeepSeek-V3's serving shape (common/models/deepseek_v3.py) beyond the logits of test_model_vs_hf: the
config's latent cache (one KV head of kv_lora_rank + qk_rope_head_dim, single plane) and softmax scale
(transformers' own, YaRN's mscale included), the MTP layers a checkpoint carries (skipped at load, refused
as draft layers), and the Triton backend (interpreted on CPU tensors) over the single-plane pool."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from common.models.config import ModelConfig
from common.models.loader import ModelLoadError, load_model
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)
from tests.unit.test_model_vs_hf import ARCH_CASES, check_model, prompt


def _dir(make_tiny_model, case: str = "deepseek_v3") -> str:
    arch, overrides = ARCH_CASES[case]
    return make_tiny_model(arch, **overrides)


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3-q-proj-yarn"])
def test_config_gives_the_latent_cache_and_transformers_scale(make_tiny_model, case):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    path = _dir(make_tiny_model, case)
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_shared) == (1, 32 + 8, True)
    assert cfg.local_kv_heads(2) == 1  # replicated on both ranks
    want = DeepseekV3Attention(AutoConfig.from_pretrained(path), 0).scaling
    assert cfg.attn_scale == pytest.approx(want, rel=1e-12)
    model, _ = load_model(path)
    assert model.attn_backend.scaling == cfg.attn_scale and model.decoder_stack is None


def test_mtp_layers_are_skipped_and_refused_as_draft_layers(make_tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _dir(make_tiny_model)
    path = str(tmp_path / "with-mtp")
    shutil.copytree(src, path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    n = raw["num_hidden_layers"]
    # an MTP layer's tensors as DeepSeek's checkpoints name them (shapes that fit nothing here)
    tensors[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.randn(3, 5)
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file(tensors, weights, metadata={"format": "pt"})
    ids = prompt(12, vocab=raw["vocab_size"])
    outs = []
    for d in (src, path):
        model, cfg = load_model(d)
        h = Harness.for_model(cfg, page_size=4)
        outs.append(model(h.extend_batch([(h.new_req(), ids)], all_logits=True)))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ModelLoadError, match="draft layers"):
        load_model(path, draft_layers=True)


def test_triton_backend_over_the_single_plane_pool(make_tiny_model):
    pytest.importorskip("triton")
    from common.layers.triton_kernels import interpreted

    if not interpreted():  # a GPU machine compiles the kernels, which then take no CPU tensors
        pytest.skip("Triton was imported without its interpreter for CPU tensors")
    check_model(_dir(make_tiny_model), page_size=4, n=36, attention_backend="triton")
