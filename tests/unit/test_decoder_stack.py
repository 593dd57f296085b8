"""Forwards through the native decoder stack (common/models/decoder_stack.py) against the layer modules,
on tiny models: extends and decode steps give the same logits, and the stack really ran; batches and
models it must not take."""

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


def forward_logits(model, cfg, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """One extend of the first two prompts together (the last rows' logits), one of the third with every
    row's logits, one of a fourth request with some rows' logits in no order, `steps` decode steps of the
    whole batch (uneven lengths), then an extend of two more tokens per request after its cached ones (a
    prefix: the modules' path)."""
    h = Harness.for_model(cfg, page_size=4, scramble_seed=5)
    rows = [h.new_req() for _ in prompts]
    out = [model(h.extend_batch([(rows[0], prompts[0]), (rows[1], prompts[1])])),
           model(h.extend_batch([(rows[2], prompts[2])], all_logits=True))]
    picked = h.extend_batch([(h.new_req(), prompts[2][:6])])
    picked.logits_indices = torch.tensor([4, 0, 2, 4])  # out of order, one row twice
    out.append(model(picked))
    for s in range(steps):
        out.append(model(h.decode_batch([(row, 3 + s + i) for i, row in enumerate(rows)])))
    out.append(model(h.extend_batch([(row, [7 + i, 8]) for i, row in enumerate(rows)])))
    return out


# head size 32: a whole block of the native prefill attention (32 floats with AVX-512, 16 with AVX2)
WIDE = {"hidden_size": 128, "head_dim": 32}


@pytest.mark.parametrize("arch,overrides,quantization", [
    ("llama", {}, None),
    ("qwen2", {}, None),  # q/k/v bias
    ("llama",
     {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}, None),
    ("qwen2", {"tie_word_embeddings": True}, "int8wo"),  # int8 panels, a quantized tied lm_head
    ("llama", {"mlp_bias": True}, "w8a8_int8"),  # int8 activations too
    ("llama", {"intermediate_size": 72}, None),  # an MLP too narrow for the fused gate-up-SiLU: unfused
])
def test_stack_matches_the_layer_modules(make_tiny_model, arch, overrides, quantization):
    model, cfg = load_model(make_tiny_model(arch, **WIDE, **overrides), quantization=quantization)
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 17)]
    calls = []
    kernel = native.decoder_stack()
    assert kernel is not None
    if model.attn_backend.native_prefill is None:
        pytest.skip("no native prefill attention for this head size")

    def counting(*args):
        calls.append(1)
        return kernel(*args)

    stack = DecoderStack.for_model(model)
    assert stack is not None and stack.extends
    stack.kernel = counting
    model.decoder_stack = stack
    fused = forward_logits(model, cfg, prompts, steps=4)
    assert len(calls) == 3 + 4  # the extends without a prefix and every decode step, not the last extend
    model.decoder_stack = None  # the layer modules
    modules = forward_logits(model, cfg, prompts, steps=4)
    shapes = [(2, cfg.vocab_size), (17, cfg.vocab_size), (4, cfg.vocab_size)] + [(3, cfg.vocab_size)] * 5
    for a, b, shape in zip(fused, modules, shapes, strict=True):
        assert a.shape == shape
        assert torch.equal(a, b)  # the same kernels in the same order


def test_a_kept_row_out_of_range_is_refused(make_tiny_model):
    model, cfg = load_model(make_tiny_model("llama", **WIDE))
    stack = DecoderStack.for_model(model)
    if stack is None or not stack.extends:
        pytest.skip("no native decoder stack for extends here")
    h = Harness.for_model(cfg, page_size=4)
    fb = h.extend_batch([(h.new_req(), [5, 6, 7])])
    model.attn_backend.init_forward_metadata(fb)
    x = torch.zeros(3, cfg.hidden_size)
    cos, sin = model.rotary.cos_sin(fb.positions)
    with pytest.raises(RuntimeError, match="-3"):
        stack.run(x, cos, sin, fb, torch.tensor([0, 3]))


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
