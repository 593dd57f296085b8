"""bench/side_by_side_vllm.py's bookkeeping: the ratios it pairs round by round, its tables and vLLM's
binding check, on reports written here (the servers themselves are not started: vLLM is not installed)."""

from __future__ import annotations

import json

from bench import side_by_side_vllm as sbs


def write_runs(folder, name: str, r: int, ttft_ms: float, tpot_ms: float, out_tok_s: float, failed: int = 0):
    """The three workloads' reports of one server in round r, as `pdserve bench serve --json` writes them."""
    for w in sbs.WORKLOADS:
        summary = {"ttft_ms": {"p50": ttft_ms, "p99": 2 * ttft_ms},
                   "tpot_ms": {"p50": tpot_ms, "p99": 2 * tpot_ms},
                   "output_throughput": out_tok_s * (2 if w == "serving" else 1), "failed": failed}
        report = {"bench": "serve", "figures": {"summary": summary}}
        (folder / f"{name}-{w}-r{r}.json").write_text(json.dumps(report))


def test_ratios_pair_each_round_with_vllms_own(tmp_path):
    for r, (v_ttft, p_ttft) in enumerate(((600.0, 540.0), (700.0, 560.0), (650.0, 650.0)), start=1):
        write_runs(tmp_path, "vllm", r, v_ttft, 40.0, 100.0)
        write_runs(tmp_path, "pdserve", r, p_ttft, 8.0, 130.0)
        write_runs(tmp_path, "pdserve_w8a8", r, p_ttft / 2, 10.0, 250.0, failed=r == 3)
    write_runs(tmp_path, "vllm", 4, 600.0, 40.0, 100.0)  # a round the others never ran is left out
    idle = [{"server": "pdserve", "workload": "single", "round": 1, "rc": 0, "seconds": 5.0,
             "idle_cpu_s": 0.2, "idle_cpu_by_server": {"vllm": 0.2, "pdserve_w8a8": 0.0}}]
    report = sbs.summarize(str(tmp_path), [1, 2, 3, 4], idle)
    fig = report["figures"]
    assert report["bench"] == "side_by_side_vllm" and "time" in report["machine"]
    assert fig["rounds"] == [1, 2, 3] and fig["idle_cpu_s_max"] == 0.2
    ttft = fig["ratios_vs_vllm"]["pdserve"]["ttft_512_s"]
    assert ttft["rounds"] == [0.9, 0.8, 1.0] and ttft["median"] == 0.9
    assert (ttft["lowest"], ttft["highest"]) == (0.8, 1.0)
    ratios = fig["ratios_vs_vllm"]
    assert ratios["pdserve"]["single_stream_tok_s"]["median"] == 5.0  # 1000 / 8 against 1000 / 40
    assert ratios["pdserve_w8a8"]["batch16_output_tok_s"]["median"] == 2.5
    assert fig["by_round"]["pdserve_w8a8"]["3"]["failed"] == 3  # one per workload
    text = sbs.tables(report)
    assert "| pdserve | 0.90 (0.80–1.00): 0.90 / 0.80 / 1.00 |" in text
    assert "| vllm | 0.60–0.70 |" in text


def test_the_binding_check_wants_the_cores_given(tmp_path):
    log, out = tmp_path / "vllm-server.log", tmp_path / "binding.log"
    lines = ["(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread binding info: \n",
             "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n",
             "(APIServer pid=2) INFO unrelated line\n"]
    log.write_text("".join(lines))
    assert sbs.check_binding(str(log), str(out), "0-1")
    assert out.read_text() == "".join(lines[:2])  # the binding lines alone are kept
    assert not sbs.check_binding(str(log), str(out), "0-3")
    log.write_text(lines[0] + lines[1].replace("[0, 1]", "[1]"))  # `auto` kept a core for the scheduler
    assert not sbs.check_binding(str(log), str(out), "0-1")
