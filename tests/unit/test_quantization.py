"""Int8 weights (`--torchao-config int8wo`) and int8 weights with int8 activations (`--quantization
w8a8_int8`), common/layers/linear.py: what is quantized, how close the model stays to float32, a scheduler
serving with them, the flags' checks, and `pdserve bench quant`."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import quant
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


def test_bench_quant_runs_and_reports_quality_and_speed(tiny_model_dir, tmp_path):
    out = tmp_path / "quant.json"
    assert quant.main(["--model", tiny_model_dir, "--ppl-tokens", "96", "--ppl-window", "32", "--prompts", "3",
                       "--greedy-tokens", "5", "--decode-steps", "2", "--repeats", "1", "--threads", "1", "--peak-size", "128",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {f"{p}_{k}" for p in ("int8", "w8a8") for k in (
        "ppl", "greedy_agreement", "decode_b1", "decode_b16", "prefill_512")} | {
        "float32_prefill_compute_bound", "w8a8_prefill_compute_bound"}
    f = report["figures"]
    assert f["ppl_tokens"] == 96 and f["greedy_identical"].keys() == {"int8wo", "w8a8_int8"}
    # the rates are sampled after the round and at the end; the bound takes the best sample
    samples = f["compute"]["peak_samples"]
    assert len(samples["float32"]) == len(samples["w8a8_gemm"]) == 2
    assert f["compute"]["float32_matmul_peak_gflops"] == max(samples["float32"])
    assert f["compute"]["int8_matmul_peak_gops"]["w8a8_gemm"] == max(samples["w8a8_gemm"])
    for scheme, key in (("int8wo", "int8"), ("w8a8_int8", "w8a8")):
        assert f[scheme]["weight_mib"] < f["float32"]["weight_mib"] / 2
        assert 0 < report["ratios"][f"{key}_ppl"] and 0 <= report["ratios"][f"{key}_greedy_agreement"] <= 1
    assert quant.agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == (4 / 6, 1)


def test_bench_quant_bound_counts_weights_not_bytes(make_tiny_model, monkeypatch):
    """The float32 model's weights are a GGUF file's blocks, which a decode step reads in fewer bytes; the
    prefill's compute bound counts the same multiplications either way (it once divided the blocks' bytes
    by 4: SmolLM2's bound came out at 0.074 s for a ~1 s prefill)."""
    from bench.engine import OurEngine

    model_dir = make_tiny_model("llama", gguf_blocks=True)
    blocks = OurEngine(model_dir, 32, 2)
    monkeypatch.setenv("PDSERVE_WEIGHT_BLOCKS", "0")
    plain = OurEngine(model_dir, 32, 2)
    assert blocks.weight_bytes() < plain.weight_bytes() / 3
    assert quant.prefill_ops(blocks) == quant.prefill_ops(plain)
    assert quant.prefill_ops(plain)[0] == 2 * (plain.weight_bytes() / 4 - plain.cfg.vocab_size * plain.cfg.hidden_size) * 512
