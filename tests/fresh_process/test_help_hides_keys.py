"""The router's and a node's `--help` and their start-up errors never show an API key from the environment,
nor a bad key file's text: each run in a fresh interpreter. The trust rules without processes:
tests/unit/test_security.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_help_and_errors_never_show_env_keys(tmp_path):
    env = {**os.environ, "PDSERVE_API_KEY": "envclient7f3a", "PDSERVE_ADMIN_API_KEY": "envadmin7f3a",
           "PDSERVE_NODE_API_KEY": "envnode7f3a", "PYTHONPATH": str(ROOT)}
    for module in ("router", "prefill_node"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "--node-api-key-file" in out.stdout, out.stderr
        assert "7f3a" not in out.stdout + out.stderr
    bad = _file(tmp_path, "bad", "has space 7f3a")
    out = subprocess.run([sys.executable, "-m", "router", "--prefill", "http://127.0.0.1:1", "--decode",
                          "http://127.0.0.1:2", "--admin-api-key-file", bad], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--admin-api-key-file" in out.stderr and "has space" not in out.stderr
