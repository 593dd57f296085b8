"""Real clients against a PD cluster of the suite (`mooncake_pd`: router + 1 prefill + 1 decode, the KV moved
by mooncake over TCP, so the answers are the model's; tiny random model): the short version of
`pdserve bench clients` (bench/clients/, bench/README.md "Real clients").

* the OpenAI SDK checks (bench/clients/openai_checks.py) with this venv's openai (the project pins the
  version the bench uses), for the tiny model's served name and the cluster's chat template
  (tests/data/chatml_tools.jinja, which does not read `reasoning_effort`), and a JSON object cut short
  by max_tokens accepted once closed (random weights never close one);
* SGLang's `bench_serving --backend sglang-oai` from the sglang client venv (`make clients-venvs`),
  located with `python -m bench.clients.venvs path sglang`.

Both run as subprocesses, exactly as the bench runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.cluster import MODEL

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "bench" / "clients"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PROMPTS = 8

pytestmark = [pytest.mark.slow, pytest.mark.backend("mooncake")]


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **OFFLINE}


def test_openai_sdk_checks(mooncake_pd):
    out = subprocess.run([sys.executable, str(CLIENTS / "openai_checks.py"), "--base-url",
                          mooncake_pd.url + "/v1",
                          "--model", MODEL, "--expect-reasoning-effort", "refused", "--json-prefix-ok",
                          "--timeout", "60"],
                         capture_output=True, text=True, timeout=240, env=client_env(), cwd=str(CLIENTS))
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"check"')]
    failed = [f"{r['check']}: {r['detail']}" for r in results if not r["ok"]]
    assert results, f"no check ran (exit {out.returncode}): {out.stderr[-2000:]}"
    assert not failed, "\n".join(failed)
    assert out.returncode == 0, out.stderr[-2000:]


def sglang_python() -> str:
    found = subprocess.run([sys.executable, "-m", "bench.clients.venvs", "path", "sglang"],
                           capture_output=True, text=True, cwd=str(ROOT), timeout=60)
    # `make test` builds it first (`make clients-venvs`): a missing one is a failure, not a skip
    assert found.returncode \
        == 0, f"the sglang client venv is not built (make clients-venvs): {found.stderr.strip()}"
    return found.stdout.strip()


def test_sglang_bench_serving(mooncake_pd, tiny_model_dir, tmp_path):
    python = sglang_python()
    dataset = tmp_path / "sharegpt.json"
    words = ("the keeper counts the ships that pass the lighthouse every night and writes each one "
             "down").split()
    dataset.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": " ".join(words[(i + j) % len(words)] for j in range(40))},
        {"from": "gpt", "value": "Done."}]} for i in range(16)]))
    out_file = tmp_path / "out.jsonl"
    run = subprocess.run([python, "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--base-url",
                          mooncake_pd.url, "--model", MODEL, "--tokenizer", tiny_model_dir,
                          "--dataset-name", "random",
                          "--dataset-path", str(dataset), "--num-prompts", str(PROMPTS),
                          "--random-input-len", "64",
                          "--random-output-len", "8", "--request-rate", "inf", "--seed", "1", "--output-file",
                          str(out_file), "--output-details", "--disable-tqdm"],
                         capture_output=True, text=True, timeout=240, env=client_env(), cwd=str(tmp_path))
    assert out_file.is_file(), f"bench_serving wrote no results (exit {run.returncode}): {run.stdout[-1500:]}"
    record = json.loads(out_file.read_text().splitlines()[-1])
    errors = [e for e in record["errors"] if e]
    assert not errors, errors[:3]
    assert record["completed"] == PROMPTS, record
    assert all(record["generated_texts"]), record["generated_texts"]
    assert run.returncode == 0, run.stdout[-1500:]
