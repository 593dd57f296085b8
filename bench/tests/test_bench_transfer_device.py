"""`pdserve bench transfer`: the cpu run end to end on the fake backend, `--device cuda` refused without a
GPU, and the cuda report (figures and ratios) built from made-up timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench import transfer as bt


def _rows(tokens: int, engine_s: list[float]) -> list[dict]:
    nbytes = -(-tokens // bt.PAGE_SIZE) * bt.page_bytes() * 2 * bt.LAYERS
    return [{"tokens": tokens, "bytes": nbytes, "regions": 5, "pagelist_s": 2 * t, "engine_pagelist_s": t,
             "raw_s": t} for t in engine_s]


def test_the_cpu_run_measures_the_fake_backend_and_writes_its_report(tmp_path):
    out = tmp_path / "transfer.json"
    report = bt.main(["--backend", "fake", "--tokens", "32", "--repeats", "1", "--rounds",
                      "1", "--json", str(out)])
    assert isinstance(report, dict)
    saved = json.loads(out.read_text())
    assert saved["ratios"] == report["ratios"]
    assert set(saved["ratios"]) == {"fake_32"}  # no vram ratio on the cpu
    figures = saved["figures"]
    assert figures["device"] == {"kind": "cpu"}
    assert figures["command"].startswith("pdserve bench transfer --backend fake")
    assert "device_copy_gbps" not in figures and figures["memcpy_gbps"]["32"] > 0
    fake = figures["backends"]["fake"]["32"]
    assert fake["bytes"] == 2 * bt.page_bytes() * 2 * bt.LAYERS
    assert fake["regions"] >= 1 and fake["repeats"] == 1
    assert "engine_pagelist_best_gbps" not in fake


def test_device_cuda_without_a_gpu_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    monkeypatch.setattr(bt, "run_backend", lambda *a, **k: ran.append(a))
    assert bt.main(["--device", "cuda", "--backend", "nixl"]) == 2
    assert capsys.readouterr().err.strip() == bt.NO_CUDA
    assert not ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_the_cli_exits_2_for_device_cuda_on_a_machine_without_one():
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "transfer", "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert bt.NO_CUDA in r.stderr


def test_a_bad_device_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        bt.main(["--device", "tpu"])
    assert e.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_vram_ratios_set_the_best_page_list_write_against_the_copy():
    figs = bt.summarize(_rows(512, [0.004, 0.002, 0.003]) + _rows(4096, [0.010, 0.008]),
                        [512, 4096], best=True)
    best_512 = figs["512"]["bytes"] / 0.002 / 1e9
    best_4096 = figs["4096"]["bytes"] / 0.008 / 1e9
    assert figs["512"]["engine_pagelist_best_gbps"] == pytest.approx(best_512)
    # the median
    assert figs["512"]["engine_pagelist_gbps"] == pytest.approx(figs["512"]["bytes"] / 0.003 / 1e9)
    other = bt.summarize(_rows(512, [0.001]) + _rows(4096, [0.004]), [512, 4096], best=True)
    backends = {"fake": {"skipped": bt.NO_BYTES}, "mooncake": {"error": "refuses cuda"},
                "nixl": figs, "ucx": other}
    copy = {"512": 2 * best_512, "4096": best_4096 / 0.5}
    ratios = bt.vram_ratios(backends, copy)
    assert ratios["nixl_512_vram"] == pytest.approx(0.5)
    assert ratios["nixl_4096_vram"] == pytest.approx(0.5)
    assert ratios["ucx_4096_vram"] == pytest.approx(1.0)
    assert ratios["transfer_vram"] == pytest.approx(ratios["nixl_4096_vram"])  # first measured, largest size
    assert not any(k.startswith(("fake", "mooncake")) for k in ratios)
    assert figs["4096"]["copy_gbps"] == copy["4096"]
    assert figs["4096"]["transfer_vram"] == pytest.approx(0.5)
    assert backends["fake"] == {"skipped": bt.NO_BYTES}


def test_no_measured_backend_gives_no_headline_ratio():
    assert bt.vram_ratios({"fake": {"skipped": bt.NO_BYTES}, "nixl": {"error": "x"}}, {"512": 1.0}) == {}


def test_the_cuda_report_has_the_copy_reference_and_the_vram_ratios(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bt, "_device_info", lambda device: {"kind": device})
    monkeypatch.setattr(bt, "device_copy_gbps", lambda nbytes, repeats: nbytes / 0.001 / 1e9)
    calls = []

    def fake_run(backend, tokens_list, repeats, rounds, device):
        calls.append((backend, device))
        if backend == "mooncake":
            raise RuntimeError("mooncake-transfer-engine-non-cuda cannot reach cuda memory")
        return bt.summarize(_rows(64, [0.002, 0.004]), tokens_list, best=True)

    monkeypatch.setattr(bt, "run_backend", fake_run)
    out = tmp_path / "t.json"
    report = bt.main(["--device", "cuda", "--backend", "nixl", "--backend", "fake", "--backend", "mooncake",
                      "--tokens", "64", "--json", str(out)])
    assert calls == [("nixl", bt.CUDA_DEVICE), ("mooncake", bt.CUDA_DEVICE)]  # fake moves no bytes: not run
    saved = json.loads(out.read_text())
    figures = saved["figures"]
    assert figures["device"] == {"kind": "cuda"}
    assert "memcpy_gbps" not in figures and figures["device_copy_gbps"]["64"] > 0
    assert figures["backends"]["fake"] == {"skipped": bt.NO_BYTES}
    assert "mooncake-transfer-engine-non-cuda" in figures["backends"]["mooncake"]["error"]
    assert saved["ratios"] == report["ratios"]
    assert saved["ratios"]["transfer_vram"] == pytest.approx(0.5)  # 2 ms best write vs a 1 ms copy
    assert saved["ratios"]["nixl_64_vram"] == pytest.approx(0.5)
    assert saved["ratios"]["nixl_64"] == pytest.approx(0.5)  # pagelist over raw, as on the cpu
