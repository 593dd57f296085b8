"""`pdserve bench quant` (bench/quant.py): its report's quality and speed figures and ratios, and the
prefill's compute bound, which counts the multiplications, not the bytes of the weights."""

from __future__ import annotations

import json

from bench import quant
from bench.engine import OurEngine


def test_bench_quant_runs_and_reports_quality_and_speed(tiny_model_dir, tmp_path):
    out = tmp_path / "quant.json"
    assert quant.main(["--model", tiny_model_dir, "--ppl-tokens", "96",
                       "--ppl-window", "32", "--prompts", "3",
                       "--greedy-tokens", "5", "--decode-steps", "2", "--repeats", "1", "--threads", "1",
                       "--peak-size", "128", "--json", str(out)]) == 0
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
    model_dir = make_tiny_model("llama", gguf_blocks=True)
    blocks = OurEngine(model_dir, 32, 2)
    monkeypatch.setenv("PDSERVE_WEIGHT_BLOCKS", "0")
    plain = OurEngine(model_dir, 32, 2)
    assert blocks.weight_bytes() < plain.weight_bytes() / 3
    assert quant.prefill_ops(blocks) == quant.prefill_ops(plain)
    projections = plain.weight_bytes() / 4 - plain.cfg.vocab_size * plain.cfg.hidden_size
    assert quant.prefill_ops(plain)[0] == 2 * projections * 512
