"""Decode steps through the native decoder stack (common/models/decoder_stack.py) against the layer
modules, on tiny models: same logits, and the stack really ran; models it must not take."""

from __future__ import annotations

import pytest
import torch

from common.layers import native
from common.models.decoder_stack import DecoderStack
from common.models.loader import load_model
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)


def decode_logits(model, cfg, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill each prompt, then `steps` decode steps of the whole batch (uneven lengths)."""
    h = Harness.for_model(cfg, page_size=4, scramble_seed=5)
    rows = [h.new_req() for _ in prompts]
    for row, p in zip(rows, prompts, strict=True):
        model(h.extend_batch([(row, p)]))
    out = []
    for s in range(steps):
        out.append(model(h.decode_batch([(row, 3 + s + i) for i, row in enumerate(rows)])))
    return out


@pytest.mark.parametrize("arch,overrides,quantization", [
    ("llama", {}, None),
    ("qwen2", {}, None),  # q/k/v bias
    ("llama",
     {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}, None),
    ("qwen2", {"tie_word_embeddings": True}, "int8wo"),  # int8 panels, a quantized tied lm_head
    ("llama", {"mlp_bias": True}, "w8a8_int8"),  # int8 activations too
])
def test_stack_matches_the_layer_modules(make_tiny_model, arch, overrides, quantization):
    model, cfg = load_model(make_tiny_model(arch, **overrides), quantization=quantization)
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 17)]
    calls = []
    kernel = native.decoder_stack()
    assert kernel is not None

    def counting(*args):
        calls.append(1)
        return kernel(*args)

    stack = DecoderStack.for_model(model)
    assert stack is not None
    stack.kernel = counting
    model.decoder_stack = stack
    fused = decode_logits(model, cfg, prompts, steps=4)
    assert len(calls) == 4  # every decode step, and no extend
    model.decoder_stack = None  # the layer modules
    modules = decode_logits(model, cfg, prompts, steps=4)
    for a, b in zip(fused, modules, strict=True):
        assert a.shape == (3, cfg.vocab_size)
        assert torch.equal(a, b)  # the same kernels in the same order


def test_models_the_stack_does_not_take(make_tiny_model, monkeypatch):
    model, _ = load_model(make_tiny_model("qwen3"))  # per-head q/k norm
    assert DecoderStack.for_model(model) is None
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "onednn")  # projections not in panels
    model, _ = load_model(make_tiny_model("llama"))
    assert DecoderStack.for_model(model) is None
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "1")
    monkeypatch.setenv("PDSERVE_DECODER_STACK", "0")
    model, _ = load_model(make_tiny_model("llama"))
    assert DecoderStack.for_model(model) is None
