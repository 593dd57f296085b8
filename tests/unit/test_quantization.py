"""Int8 weights (`--torchao-config int8wo`) and int8 weights with int8 activations (`--quantization
w8a8_int8`), common/layers/linear.py: what is quantized, how close the model stays to float32, a scheduler
serving with them, and the flags' checks. `pdserve bench quant` is tested in bench/tests."""

from __future__ import annotations

import argparse

import pytest
import torch

from common.config import ConfigError, ServerArgs
from common.layers.linear import Panels
from common.models.loader import load_model
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)
from tests.unit.test_engine_correctness import Engine


def prefill_logits(model, cfg, prompt: list[int]) -> torch.Tensor:
    h = Harness.for_model(cfg, page_size=4, scramble_seed=1)
    fb = h.extend_batch([(h.new_req(), prompt)])
    fb.logits_indices = torch.arange(len(prompt))
    return model(fb)


@pytest.mark.parametrize("quantization,tied", [("int8wo", True), ("w8a8_int8", True), ("w8a8_int8", False)])
def test_int8_model_quantizes_every_projection_and_the_lm_head(make_tiny_model, quantization, tied):
    path = make_tiny_model("llama", tie_word_embeddings=tied)
    ref, cfg = load_model(path)
    q8, _ = load_model(path, quantization=quantization)
    head = q8.lm_head_packed if tied else q8.lm_head.packed
    projections = [m for m in q8.modules() if getattr(m, "packed", None) is not None and m is not q8.lm_head]
    assert projections and all(isinstance(m.packed, Panels) and m.packed.weight.dtype == torch.int8
                               for m in projections)
    assert all(m.packed.int8_activations == (quantization == "w8a8_int8") for m in projections)
    # the lm_head is weight-only int8 with either scheme: the logits see float32 activations
    assert head.weight.dtype == torch.int8 and head.scale is not None and not head.int8_activations
    assert q8.model.embed_tokens.weight.dtype == torch.float32  # the embedding keeps its float32 copy
    assert torch.equal(q8.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    prompt = list(range(3, 40))
    a, b = prefill_logits(ref, cfg, prompt), prefill_logits(q8, cfg, prompt)
    assert not torch.equal(a, b)  # it really is another model
    rel = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
    assert rel < 0.05, rel
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.8


@pytest.mark.parametrize("flags", [{"torchao_config": "int8wo"}, {"quantization": "w8a8_int8"}])
def test_a_scheduler_serves_with_int8_weights(tiny_model_dir, flags):
    eng = Engine(tiny_model_dir, **flags)
    vocab = eng.sched.runner.vocab_size
    packed = eng.sched.runner.model.model.layers[0].mlp.down_proj.packed
    assert isinstance(packed, Panels) and packed.int8_activations == ("quantization" in flags)
    for i, n in enumerate((5, 19, 33)):
        eng.submit(f"r{i}", [(7 * j + i) % vocab for j in range(n)], max_new=9)
    out = eng.run()
    assert sorted(out) == ["r0", "r1", "r2"] and all(len(toks) == 9 for toks in out.values())
    eng.assert_restored()


def test_the_flag_names_what_it_accepts():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--torchao-config", "int8wo"]).torchao_config == "int8wo"
    assert parser.parse_args([]).torchao_config == ""
    with pytest.raises(SystemExit):
        parser.parse_args(["--torchao-config", "int4wo-128"])  # argparse names the flag and its choices
    assert parser.parse_args(["--quantization", "w8a8_int8"]).quantization == "w8a8_int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp8"])
    both = ServerArgs(model="default", quantization="w8a8_int8", torchao_config="int8wo")
    with pytest.raises(ConfigError, match="--quantization: w8a8_int8 quantizes the weights itself"):
        both.validate()
    assert ServerArgs(model="default", quantization="w8a8_int8").weight_quantization == "w8a8_int8"
    assert ServerArgs(model="default", torchao_config="int8wo").weight_quantization == "int8wo"
    assert ServerArgs(model="default").weight_quantization is None
