"""Fixtures for the PD node tests: the tiny model, its tokenizer and a colocated reference node
(helpers live in pd_harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pd_harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # node_process
from node_process import NodeProcess  # noqa: E402
from pd_harness import BASE, FAST_ENV  # noqa: E402


# ---------------------------------------------------------------------------------------------- model
def _build_tiny_model(path: Path) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from common.models.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights: sharper logits, so greedy ties cannot happen
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def pd_model_dir(request, tmp_path_factory) -> str:
    """The shared tiny model when tests/conftest.py provides one, else one made here."""
    try:
        return request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        return _build_tiny_model(tmp_path_factory.mktemp("pd-tiny-llama"))


@pytest.fixture(scope="session")
def pd_tok(pd_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pd_model_dir)


@pytest.fixture(scope="session")
def colocated(pd_model_dir):
    """A colocated node (`pdserve serve`) with the same settings: the reference answers."""
    node = NodeProcess(pd_model_dir, env=FAST_ENV, **BASE)
    node.start()
    yield node
    node.stop()
