"""`pdserve bench gpu` on a CPU: the tiny shape through the real runner (eager, torch_native), so the rows,
the roofline arithmetic, the skipped backends and the headline ratios are checked without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from bench.gpu import run as bench_gpu
from common.models.config import ModelConfig
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)

# the tiny shape: 2 layers, 2 KV heads of 16, float32
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(dict(bench_gpu.SHAPES["tiny"], architectures=["LlamaForCausalLM"],
                                      max_position_embeddings=131072,
                                      rope_scaling=dict(bench_gpu.LLAMA3_ROPE)))


def test_bench_gpu_on_cpu_reports_decode_prefill_and_ratios(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--backends", "torch_native,flashinfer", "--batches", "3,1",
            "--context", "20", "--decode-steps", "3", "--warmup", "1",
            "--prefill-tokens", "40", "--repeats", "2", "--overlap-batches", "1,3", "--json", str(out)]
    result = bench_gpu.main(argv)
    assert isinstance(result, dict)
    saved = json.loads(out.read_text())
    assert set(saved) == {"bench", "machine", "device", "command", "config", "ratios", "figures"}
    report = {**saved, **saved["figures"]}  # the measured parts live under figures
    assert report["command"] == ["pdserve", "bench", "gpu", *argv]
    assert report["device"]["type"] == "cpu" and report["device"]["name"]
    ref = report["references"]
    assert ref["copy_gbps"] > 0 and ref["matmul_tflops"] > 0 and ref["matmul_dtype"] == "float32"
    assert report["backends"]["flashinfer"] == {"status": "skipped",
                                                "reason": "the flashinfer-python package is not installed"}
    assert report["backends"]["torch_native"]["status"] == "measured"
    assert report["backends"]["torch_native"]["cuda_graph_batch_sizes"] == []  # no graphs on cpu

    weights = bench_gpu.decode_weight_bytes(_tiny_config(), 4)
    assert [(r["backend"], r["graphs"], r["batch"]) for r in report["decode"]] == [
        ("torch_native", False, 1), ("torch_native", False, 3)]
    for r in report["decode"]:
        assert r["weight_bytes"] == weights
        # each timed step attends over the context, the earlier steps' tokens and its own: 20 + 2 on average
        assert r["kv_bytes"] == r["batch"] * 22 * TINY_KV_BYTES_PER_TOKEN
        assert r["roofline_ms"] == pytest.approx((weights + r["kv_bytes"]) / (ref["copy_gbps"] * 1e6))
        assert r["ratio"] == pytest.approx(r["roofline_ms"] / r["step_ms"])
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["step_ms"])
        assert len(r["runs_ms"]) == 2 and min(r["runs_ms"]) == pytest.approx(r["step_ms"], abs=1e-3)

    (p,) = report["prefill"]
    assert p["backend"] == "torch_native" and p["tokens"] == 40
    assert p["flops"] == pytest.approx(bench_gpu.prefill_flops(_tiny_config(), 40))
    assert p["tflops"] == pytest.approx(p["flops"] / (p["ms"] * 1e9))
    assert p["ratio"] == pytest.approx(p["tflops"] / ref["matmul_tflops"])

    ratios = report["ratios"]
    # overlap through the scheduler loop, on the first backend that ran (no target); one torch thread here
    overlap = report["overlap"]
    assert overlap["backend"] == "torch_native" and overlap["graphs"] is False
    assert {k for k in ratios if k.startswith("overlap_")} == {"overlap_b1", "overlap_b3"}
    for b in (1, 3):
        fig = overlap["figures"][f"loop_decode_b{b}"]
        assert fig["tokens_identical"] is True and fig["step_ms_overlap"] > 0
        assert ratios[f"overlap_b{b}"]["value"] \
            == pytest.approx(fig["step_ms_sequential"] / fig["step_ms_overlap"],
                             abs=1e-4)
        assert ratios[f"overlap_b{b}"]["target"] is None
    ratios = {k: v for k, v in ratios.items() if not k.startswith("overlap_")}
    assert set(ratios) == set(bench_gpu.TARGETS)
    b1 = ratios["decode_b1_roofline"]
    assert b1["target"] == 0.75 and b1["backend"] == "torch_native" and b1["graphs"] is False
    assert b1["value"] == pytest.approx(report["decode"][0]["ratio"], abs=1e-4)
    assert b1["met"] is (b1["value"] >= 0.75)
    # batch 64 was not asked for: no value, not met
    assert ratios["decode_b64_roofline"] == {"value": None, "target": 0.6, "met": False, "backend": None,
                                             "graphs": False}
    assert ratios["prefill_8k_peak"]["value"] == pytest.approx(p["ratio"], abs=1e-4)


def test_decode_steps_write_their_own_kv_slots_only():
    """The timed steps run real forwards: the batch's requests get K and V at their decode positions, the
    request left out of the batch does not."""
    import tempfile
    from types import SimpleNamespace

    with tempfile.TemporaryDirectory() as model_dir:
        bench_gpu.write_config(model_dir, "tiny")
        args = SimpleNamespace(batches=[3], overlap_batches=[], context=5, decode_steps=4, prefill_tokens=8,
                               device="cpu")
        runner = bench_gpu.build_runner(model_dir, args, "torch_native", "float32")
        work = bench_gpu.Workload(runner, 3, 5, 4, 8)
        work.prefill_contexts()
        pool = runner.kv_pool

        def k_norm(request: int, pos: int) -> float:
            slot = work.slots[request, pos : pos + 1]
            rows = pool.token_rows(slot).reshape(-1) + pool.layer_offset(0)
            return float(pool.flat[rows].abs().sum())

        assert all(k_norm(i, 4) > 0 for i in range(3))  # the prompts' last tokens are in the pool
        assert all(k_norm(i, 5) == 0 for i in range(3))  # no decode step has run yet
        times = work.decode(2, warmup=0, repeats=1)
        assert len(times) == 1 and times[0] > 0
        assert all(k_norm(i, pos) > 0 for i in range(2) for pos in range(5, 9))
        assert all(k_norm(2, pos) == 0 for pos in range(5, 9))


def test_llama8b_shape_counts_the_published_parameters():
    cfg = ModelConfig.from_dict(dict(bench_gpu.SHAPES["llama8b"], architectures=["LlamaForCausalLM"],
                                     max_position_embeddings=131072,
                                     rope_scaling=dict(bench_gpu.LLAMA3_ROPE)))
    c = bench_gpu.weight_counts(cfg)
    assert c["layers"] + c["lm_head"] + c["embedding"] == 8_030_261_248  # Llama-3.1-8B
    # a bfloat16 decode step reads every weight but the embedding (a lookup of the batch's rows)
    assert bench_gpu.decode_weight_bytes(cfg, 2) == 2 * (8_030_261_248 - 128256 * 4096)


def test_llama8b_is_refused_on_cpu_and_nothing_measured_is_an_error(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.main(["--shape", "llama8b", "--device", "cpu"])
    assert "--shape tiny" in capsys.readouterr().err
    rc = bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--backends", "flashinfer", "--batches", "1",
                         "--context", "4", "--decode-steps", "1", "--warmup", "0", "--prefill-tokens", "4",
                         "--repeats", "1"])
    assert rc == 1


def test_backend_availability_reasons(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench_gpu.backend_unavailable("torch_native", cpu) is None
    assert bench_gpu.backend_unavailable("flashinfer", cpu) \
        in ("the flashinfer-python package is not installed",
             "flashinfer runs on cuda only")
    if bench_gpu.importlib.util.find_spec("triton") is None:
        assert bench_gpu.backend_unavailable("triton", cpu) == "the triton package is not installed"
        return
    assert "TRITON_INTERPRET=1" in bench_gpu.backend_unavailable("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert bench_gpu.backend_unavailable("triton", cpu) is None
