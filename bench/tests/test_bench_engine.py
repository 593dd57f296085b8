"""`pdserve bench engine` end to end on a tiny model (short runs, no HF): it exits 0 and reports the
decode step through the scheduler loop with overlap on and off, and with n-gram speculation on and off,
with identical tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine import main
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)


def test_bench_engine_reports_the_overlap_and_speculation_ratios(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))  # the draft-layer checkpoints
    out = tmp_path / "engine.json"
    rc = main(["--model", tiny_model_dir, "--skip-hf", "--decode-steps", "6", "--decode-prompt-len", "8",
               "--prompt-len", "16", "--repeats", "1", "--threads", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for b in (1, 16):
        loop = report["figures"][f"loop_decode_b{b}"]
        assert loop["tokens_identical"] is True
        assert loop["step_ms_overlap"] > 0 and loop["step_ms_sequential"] > 0
        assert 0 < loop["loop_ms_sequential"] < loop["step_ms_sequential"] and loop["overlap_ceiling"] > 1
        assert report["ratios"][f"overlap_b{b}"] > 0
    c = report["figures"]["compute"]  # the 16-token prefill against the matmul peak
    # the peak: sampled after each timed decode (b1, b16) and prefill run and once at the end, the best kept
    assert len(c["matmul_peak_samples"]) == 4 and c["matmul_peak_gflops"] == max(c["matmul_peak_samples"])
    assert c["bound_prefill_s"] == c["prefill_flops"] / (c["matmul_peak_gflops"] * 1e9) > 0
    assert report["ratios"]["prefill_compute_bound"] \
        == pytest.approx(c["bound_prefill_s"] / c["ours_prefill_s"],
                         abs=1e-4)  # ratios keep 4 decimals
    # the same FLOPs at the cores' FMA rate, which is above the matmul peak (that is torch.mm's own rate)
    assert c["fma_peak_gflops"] > c["matmul_peak_gflops"]
    assert len(c["fma_peak_samples"]) == 2 and c["fma_peak_gflops"] == max(c["fma_peak_samples"])
    assert report["ratios"]["prefill_fma_bound"] == pytest.approx(
        c["prefill_flops"] / (c["fma_peak_gflops"] * 1e9) / c["ours_prefill_s"], abs=1e-4)
    assert report["ratios"]["prefill_fma_bound"] < report["ratios"]["prefill_compute_bound"]
    roof = report["figures"]["roofline_b16"]  # each part at the longer of its FLOPs and its bytes
    assert roof["step_ms"] == pytest.approx(max(roof["matmuls_compute_ms"], roof["matmuls_memory_ms"])
                                            + max(roof["attention_compute_ms"], roof["attention_memory_ms"]))
    assert roof["step_ms"] >= c["bound_b16_step_ms"] * (1 - 1e-9)  # never below the compute bound
    # the K and V again at the rate of the pool's own runs (a page of one layer and head, scattered)
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert roof["page_run_bytes"] == 16 * head_dim * 4 and roof["page_run_read_gbps"] > 0  # 16-token pages
    assert roof["attention_page_runs_ms"] \
        == pytest.approx(roof["kv_bytes"] / (roof["page_run_read_gbps"] * 1e6))
    assert roof["step_page_runs_ms"] == pytest.approx(max(roof["matmuls_compute_ms"],
                                                          roof["matmuls_memory_ms"])
                                                      + max(roof["attention_compute_ms"],
                                                            roof["attention_page_runs_ms"]))
    assert report["ratios"]["roofline_b16"] \
        == pytest.approx(roof["step_ms"] / c["ours_b16_step_ms"], abs=1e-4)
    # (a random tiny model need not copy the passage: no accept figures)
    spec = report["figures"]["spec_ngram_b1"]
    # (differing tokens end the bench: exit 1)
    assert spec["decoded_tokens"] == 5 and spec["draft_tokens"] == 4
    assert report["ratios"]["spec_ngram"] == pytest.approx(spec["tok_s_spec"] / spec["tok_s_plain"], rel=1e-3)
    for key in ("spec_ngram_b16", "spec_ngram_chat", "spec_ngram_chat_b16"):
        assert report["ratios"][key] > 0
    assert report["figures"]["spec_ngram_chat_b16"]["decoded_tokens"] == 16 * 5
    exact = report["figures"]["spec_mtp_exact_b16"]  # every draft accepted: chains of 3 + the target's own
    assert exact["decoded_tokens"] == 16 * 5 and exact["spec_accept_rate"] == 1.0
    assert report["ratios"]["spec_mtp_exact_b16"] \
        == pytest.approx(exact["tok_s_spec"] / exact["tok_s_plain"], rel=1e-3)
    assert report["ratios"]["spec_mtp_random"] > 0 \
        and report["figures"]["spec_mtp_random_b1"]["spec_draft_tokens"] > 0


def test_the_compute_bound_counts_weights_not_bytes(make_tiny_model, monkeypatch):
    """A GGUF model's small matmuls read 4- and 8-bit blocks: fewer bytes a step, the same multiplications."""
    from bench.engine import OurEngine

    model_dir = make_tiny_model("llama", gguf_blocks=True)
    blocks = OurEngine(model_dir, 32, 2)
    monkeypatch.setenv("PDSERVE_WEIGHT_BLOCKS", "0")
    plain = OurEngine(model_dir, 32, 2)
    assert blocks.weight_count() == plain.weight_count() == plain.weight_bytes() // 4
    assert blocks.weight_bytes() < plain.weight_bytes() / 3
    # a batch above the blocks' row limit reads the float32 panels: the roofline counts those bytes
    assert blocks.weight_bytes(16) == plain.weight_bytes(16) == plain.weight_bytes()
