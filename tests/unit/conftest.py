"""Fixtures of the in-process engine tests: transformers' copy of the tiny model and its vocabulary size."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    m.eval()
    m.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def vocab(hf_model):
    return hf_model.config.vocab_size
