"""`pdserve bench startup` (bench/startup.py) starts a real node each way, checks from its log that it
took that way, and leaves the remembered tokenizer entry as the first start wrote it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common.server.tokenizer_load import cache_path, read_entry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_startup_times_each_way_and_restores_the_entry(make_tiny_model, tmp_path):
    # a config of its own: no other test shares its entry
    model = make_tiny_model("llama", rms_norm_eps=1.5e-5)
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "startup",
                          "--model", model, "--rounds", "1",
                          "--log-dir", str(tmp_path / "logs"), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"startup_cpu_speedup", "startup_front_end_cpu_speedup",
                                     "startup_ready_speedup"}
    for mode in ("first", "transformers", "light"):
        figures = report["figures"][mode]
        assert len(figures["ready_s"]["all"]) == 1 \
            and figures["cpu_s"]["median"] >= figures["front_end_cpu_s"]["median"] > 0
    assert sorted(os.listdir(tmp_path / "logs")) == ["00-first.log", "00-light.log", "00-transformers.log"]
    entry = read_entry(cache_path(model, None))
    assert entry["light"] is True and entry["class"] == "TokenizersBackend"
