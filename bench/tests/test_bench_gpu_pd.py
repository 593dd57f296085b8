"""`pdserve bench gpu-pd` on a CPU: what runs without a GPU (the ratios and the report from made-up latencies,
the refusal without a device, the flags, the seeded workload, the tokenizer it makes and the stand-in of the
default model bench/gpu/check.sh builds), and the integration suite's device switch
(`PDSERVE_TEST_DEVICE`, tests/harness/cluster.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.gpu import pd
from bench.serve import RequestResult, summarize
from tests.harness.cluster import CUDA_SHARE, device_settings
from tests.harness.nodes import ROOT


def _results(itl_s: list[float], n: int, output_len: int) -> list[RequestResult]:
    return [RequestResult(ok=True, tag="default", prompt_len=100, output_len=output_len, ttft=0.05,
                          latency=0.05 + sum(itl_s), itl=list(itl_s)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- ratios
def test_ratios_from_made_up_latencies():
    # colocated: every 10th gap is a 200 ms prefill stall; pd: 20 ms gaps throughout
    col = summarize(_results([0.2 if i % 10 == 0 else 0.01 for i in range(20)], 8, 21), duration=10.0)
    dis = summarize(_results([0.02] * 20, 8, 21), duration=12.5)
    assert col["itl_ms"]["p99"] == pytest.approx(200.0) and dis["itl_ms"]["p99"] == pytest.approx(20.0)
    ratios = pd.compute_ratios(col, dis)
    assert ratios["pd_itl_p99"] == {"value": 10.0, "target": 2.0, "met": True}
    # 168 output tokens in 12.5 s against the same in 10 s
    assert ratios["pd_throughput"] == {"value": 0.8, "target": 0.9, "met": False}


def test_ratio_without_a_figure_is_none_and_not_met():
    assert pd.ratio_entry("pd_throughput", 5.0, None) == {"value": None, "target": 0.9, "met": False}
    assert pd.ratio_entry("pd_throughput", 5.0, 0.0)["value"] is None
    assert pd.ratio_entry("pd_itl_p99", None, 3.0)["met"] is False
    assert pd.compute_ratios(None, None)["pd_itl_p99"]["value"] is None
    no_itl = summarize(_results([], 2, 1), duration=1.0)  # one token each: no gap measured
    assert pd.compute_ratios(no_itl, no_itl)["pd_itl_p99"]["value"] is None


def test_report_follows_each_setup_and_is_json():
    report = pd.new_report(["--num-prompts", "8"], {"num_prompts": 8},
                           {"name": "made-up GPU", "type": "cuda"})
    assert report["command"] == ["pdserve", "bench", "gpu-pd", "--num-prompts", "8"]
    assert report["bench"] == "gpu-pd" and report["device"]["name"] == "made-up GPU" \
        and report["machine"]["cpu"]
    col = summarize(_results([0.03] * 4, 4, 5), duration=2.0)
    pd.add_setup(report, "colocated", {"flags": ["--device", "cuda"], "summary": col})
    assert report["ratios"]["pd_throughput"]["value"] is None  # the pair has not run yet
    assert not pd.succeeded(report, ["colocated", "pd"]) and pd.succeeded(report, ["colocated"])
    dis = summarize(_results([0.01] * 4, 4, 5), duration=1.0)
    pd.add_setup(report, "pd", {"flags": ["--device", "cuda"], "summary": dis})
    assert report["ratios"]["pd_itl_p99"]["value"] == pytest.approx(3.0)
    assert report["ratios"]["pd_throughput"]["value"] == pytest.approx(2.0)
    assert pd.succeeded(report, ["colocated", "pd"])
    json.loads(json.dumps(report))  # plain JSON throughout
    # a request that failed, or a setup that could not start, is not a success
    failed = summarize([*_results([0.01], 1, 2),
                        RequestResult(ok=False, tag="default", prompt_len=3, error="x")], 1.0)
    pd.add_setup(report, "pd", {"summary": failed})
    assert not pd.succeeded(report, ["pd"])
    pd.add_setup(report, "pd", {"error": "ClusterError: decode-0 exited"})
    assert not pd.succeeded(report, ["pd"]) and report["ratios"]["pd_itl_p99"]["value"] is None


# ---------------------------------------------------------------------------------------------- CLI
def test_without_a_gpu_it_exits_2_with_one_line(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "pd.json"
    assert pd.main(["--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0]
    assert not out.exists()


def test_the_cli_knows_the_bench(monkeypatch):
    import torch

    from deploy import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.BENCHES["gpu-pd"] == "bench.gpu.pd"
    assert cli.main(["bench", "gpu-pd"]) == 2


@pytest.mark.parametrize("argv,flag", [
    (["--pd-fraction", "0.5"], "--pd-fraction"),
    (["--colocated-fraction", "0"], "--colocated-fraction"),
    (["--input-len", "4000", "--output-len", "128"], "--context-length"),
    (["--request-rate", "0"], "--request-rate"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--input-range-ratio", "1.5"], "--input-range-ratio"),
    (["--warmup-requests", "-1"], "--warmup-requests"),
    (["--transfer-backend", "fake"], "--transfer-backend"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        pd.parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_node_flags_put_every_node_on_the_gpu():
    ns = pd.parse_args(["--max-concurrency", "12", "--node-args", "--page-size 32"])
    flags = pd.node_flags(ns, "bfloat16", 0.4)
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == {"--device": "cuda", "--load-format": "dummy", "--dtype": "bfloat16",
                     "--mem-fraction-static": "0.4", "--cuda-graph-max-bs": "12", "--context-length": "4096",
                     "--page-size": "32"}


# ---------------------------------------------------------------------------------------------- workload
def test_workload_is_seeded_and_within_its_lengths():
    a = pd.make_requests(40, 1024, 128, 128256, seed=3, range_ratio=0.9)
    b = pd.make_requests(40, 1024, 128, 128256, seed=3, range_ratio=0.9)
    c = pd.make_requests(40, 1024, 128, 128256, seed=4, range_ratio=0.9)
    assert [r.prompt for r in a] == [r.prompt for r in b] and [r.prompt for r in a] != [r.prompt for r in c]
    lengths = [len(r.prompt) for r in a]
    assert all(921 <= n <= 1024 for n in lengths) and len(set(lengths)) > 1
    assert all(r.prompt_len == len(r.prompt) and r.output_len == 128 and r.api == "completions" for r in a)
    ids = [t for r in a for t in r.prompt]
    assert min(ids) >= pd.FIRST_PROMPT_ID and max(ids) < 128256
    fixed = pd.make_requests(5, 64, 8, 512, seed=0, range_ratio=1.0)
    assert [len(r.prompt) for r in fixed] == [64] * 5
    with pytest.raises(ValueError, match="vocabulary"):
        pd.make_requests(1, 8, 8, pd.FIRST_PROMPT_ID, seed=0)


# ---------------------------------------------------------------------------------------------- tokenizer
def test_the_tokenizer_made_here_has_the_vocabulary_and_a_word_per_id(tmp_path):
    from transformers import AutoTokenizer

    pd.write_tokenizer(str(tmp_path), 300, bos_id=1, eos_id=299, pad_id=0, unk_id=2)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 300
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 299, 0, 2)
    ids = [5, 17, 298, 3]
    assert tok.decode(ids) == "w5 w17 w298 w3"
    assert tok("w5 w17 unknown").input_ids == [5, 17, 2]
    assert tok.decode([1, 7, 299], skip_special_tokens=True) == "w7"
    assert "assistant:" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    with pytest.raises(ValueError, match="distinct"):
        pd.write_tokenizer(str(tmp_path / "bad"), 300, bos_id=1, eos_id=1)


def test_the_default_model_stand_in_is_what_the_suite_reads(tmp_path, monkeypatch, tokenizer_dir):
    from common.models.default_model import resolve_model_path
    from common.models.tiny_model import build_tiny_model

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    made = pd.write_default_stand_in(str(tmp_path / "cache"),
                                     str(tmp_path / "no-tokenizer-here"), vocab_size=600)
    assert resolve_model_path("default") == made  # taken as converted: nothing to convert
    with open(os.path.join(made, "config.json")) as f:
        assert json.load(f)["vocab_size"] == 600
    tiny = tmp_path / "tiny"
    build_tiny_model(str(tiny), "llama", made, {})
    with open(tiny / "config.json") as f:
        assert json.load(f)["vocab_size"] == 600
    # with the carried tokenizer (here the default model's own): its files, its vocabulary
    carried = pd.write_default_stand_in(str(tmp_path / "cache2"), tokenizer_dir)
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb") as a, \
            open(os.path.join(carried, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    with open(os.path.join(carried, "config.json")) as f:
        assert json.load(f)["vocab_size"] == pd.DEFAULT_VOCAB


# ---------------------------------------------------------------------------------------------- suite device
SUITE_SETTINGS = ('{"page_size": 16, "chunked_prefill_size": 32, "max_total_tokens": 8192, '
                  '"max_running_requests": 64, "num_threads": 1, "log_level": "info", '
                  '"served_model_name": "tiny"}')


def _suite_settings(device: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_TEST_DEVICE"}
    if device is not None:
        env["PDSERVE_TEST_DEVICE"] = device
    code = "import json; from tests.harness.cluster import NODE_SETTINGS; print(json.dumps(NODE_SETTINGS))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_without_the_variable_the_suite_settings_are_the_cpu_ones():
    for device in (None, "", "cpu"):
        out = _suite_settings(device)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == SUITE_SETTINGS, device


def test_on_cuda_every_node_gets_the_device_and_a_share():
    out = _suite_settings("cuda")
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)
    assert settings == {**json.loads(SUITE_SETTINGS), "device": "cuda", "mem_fraction_static": CUDA_SHARE}
    assert 5 * CUDA_SHARE < 1  # 2 prefill + 2 decode nodes and a colocated one on one GPU
    with pytest.raises(ValueError, match="PDSERVE_TEST_DEVICE"):
        device_settings("gpu")
    bad = _suite_settings("gpu0")
    assert bad.returncode != 0 and "PDSERVE_TEST_DEVICE" in bad.stderr
