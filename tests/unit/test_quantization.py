"""Int8 weights (`--torchao-config int8wo`, common/layers/linear.py): what is quantized, how close the
model stays to float32, a scheduler serving with them, the flag's checks, and `pdserve bench quant`."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import quant
from common.config import ServerArgs
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


def test_int8_model_quantizes_every_projection_and_the_tied_lm_head(make_tiny_model):
    path = make_tiny_model("llama", tie_word_embeddings=True)
    ref, cfg = load_model(path)
    q8, _ = load_model(path, quantization="int8wo")
    projections = [m for m in q8.modules() if getattr(m, "packed", None) is not None]
    assert projections and all(isinstance(m.packed, Panels) and m.packed.weight.dtype == torch.int8
                               for m in projections)
    assert q8.lm_head_packed.weight.dtype == torch.int8 and q8.lm_head_packed.scale is not None
    assert q8.model.embed_tokens.weight.dtype == torch.float32  # the embedding keeps its float32 copy
    assert torch.equal(q8.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    prompt = list(range(3, 40))
    a, b = prefill_logits(ref, cfg, prompt), prefill_logits(q8, cfg, prompt)
    assert not torch.equal(a, b)  # it really is another model
    rel = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
    assert rel < 0.05, rel
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.8


def test_a_scheduler_serves_with_int8_weights(tiny_model_dir):
    eng = Engine(tiny_model_dir, torchao_config="int8wo")
    vocab = eng.sched.runner.vocab_size
    assert isinstance(eng.sched.runner.model.model.layers[0].mlp.down_proj.packed, Panels)
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


def test_bench_quant_runs_and_reports_quality_and_speed(tiny_model_dir, tmp_path):
    out = tmp_path / "quant.json"
    assert quant.main(["--model", tiny_model_dir, "--ppl-tokens", "96", "--ppl-window", "32", "--prompts", "3",
                       "--greedy-tokens", "5", "--decode-steps", "2", "--repeats", "1", "--threads", "1",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"int8_ppl", "int8_greedy_agreement", "int8_decode_b1", "int8_decode_b16",
                                     "int8_prefill_512"}
    f = report["figures"]
    assert f["ppl_tokens"] == 96 and f["int8wo"]["weight_mib"] < f["float32"]["weight_mib"] / 2
    assert 0 < report["ratios"]["int8_ppl"] and 0 <= report["ratios"]["int8_greedy_agreement"] <= 1
    assert quant.agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == (4 / 6, 1)
