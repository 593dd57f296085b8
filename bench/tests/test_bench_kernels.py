"""`pdserve bench kernels` (bench/kernels.py): this checkout's GEMMs and prefill attention against another
revision's, built from git into the kernel cache; the short version compares against HEAD."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench import kernels
from common.layers import native

pytestmark = pytest.mark.skipif(native.packed_gemm() is None, reason="no native GEMM on this machine")


def test_bench_kernels_reports_ratios_and_bits_against_a_revision(tmp_path):
    out = tmp_path / "kernels.json"
    report = kernels.main(["--baseline", "HEAD", "--rows", "1,16", "--calls", "2", "--json", str(out)])
    # (w8a8 against HEAD only where HEAD reads the same w8a8 panels)
    w8a8 = set() if "w8a8_baseline" in report["figures"] else {"w8a8_r1", "w8a8_r16"}
    assert set(report["ratios"]) == {"fp32_r1", "fp32_r16", "int8_r1", "int8_r16", "q4_r1", "w8a8_vs_fp32_r1",
                                     "w8a8_vs_fp32_r16", "q4_r16", "q8_r1", "q8_r16", "attn_r16",
                                     "attn_torch_r16"} | w8a8
    assert all(r > 0 for r in report["ratios"].values())
    saved = json.loads(out.read_text())
    # blocks against float32 panels of the same weights: the same bits, from any revision
    assert all(saved["figures"][key]["same_bits"] is True for key in ("q4_r1", "q4_r16", "q8_r1", "q8_r16"))
    assert saved["figures"]["baseline"] == "HEAD"
    # which CPU generation ran it, where /proc/cpuinfo says (x86 Linux)
    with open("/proc/cpuinfo") as f:
        says = "cpu family" in f.read()
    assert ("?" not in saved["machine"]["cpu_family_model"]) == says, saved["machine"]["cpu_family_model"]
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--",
                                "common/layers"], cwd=kernels.ROOT).returncode == 0
    if unchanged:  # the same sources as HEAD's compute the same bits
        compared = [key for key in report["ratios"] if not key.startswith(("attn_torch", "w8a8_vs_fp32"))]
        assert all(saved["figures"][key]["same_bits"] is True for key in compared), saved["figures"]


def test_a_baseline_with_another_w8a8_layout_is_left_out_of_the_w8a8_comparison(tmp_path):
    """58245c0 packed w8a8 weights in pairs of k for AVX2 and bounded them by 127: its kernel cannot read
    this checkout's panels, so only this checkout's w8a8 against its float32 is reported."""
    if subprocess.run(["git", "cat-file", "-e", "58245c0^{commit}"], cwd=kernels.ROOT).returncode:
        pytest.skip("this clone lacks revision 58245c0")
    report = kernels.main(["--baseline", "58245c0", "--rows", "16", "--calls", "1", "--isa", "avx2",
                           "--json", str(tmp_path / "k.json")])
    assert "w8a8_r16" not in report["ratios"] and report["ratios"]["w8a8_vs_fp32_r16"] > 0
    assert report["figures"]["w8a8_baseline"].startswith("skipped")
    assert report["figures"]["isa"] == "avx2" and report["figures"]["w8a8_group"] == 4


def test_an_unknown_revision_is_refused_naming_it():
    with pytest.raises(SystemExit, match="--baseline no-such-rev: cannot read common/layers/"):
        kernels.main(["--baseline", "no-such-rev", "--rows", "1"])


def test_layers_run_each_shape_through_that_many_weight_copies(tmp_path, monkeypatch):
    seen = []
    real = kernels._gemm_call
    monkeypatch.setattr(kernels, "_gemm_call",
                        lambda fn, heads, *rest: (seen.append(len(heads)), real(fn, heads, *rest)))
    report = kernels.main(["--rows", "4", "--calls", "1", "--layers", "3", "--json",
                           str(tmp_path / "k.json")])
    assert report["figures"]["layers"] == 3 and set(seen) == {3}
    with pytest.raises(SystemExit, match="--layers must be >= 1"):
        kernels.main(["--rows", "1", "--layers", "0"])
