"""A model's generation_config sampling reaches every node: a request that names no sampling is sampled
with the model's values on a colocated node and on both legs of a PD pair, the prefill node's first
token included (`--sampling-defaults openai`, which ignores the file:
tests/unit/test_sampling_defaults.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.harness.client import http, http_post

pytestmark = pytest.mark.backend("nixl")

PROMPT = {"input_ids": [5, 17, 29, 41, 53, 65, 77, 89], "sampling_params": {"max_new_tokens": 12}}


@pytest.fixture(scope="module")
def greedy_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model whose generation_config asks for greedy sampling (temperature 0)."""
    out = tmp_path_factory.mktemp("greedy-default") / "model"
    shutil.copytree(tiny_model_dir, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 0.0, "top_p": 0.5}))
    return str(out)


def _tokens(status_body) -> list[int]:
    status, body = status_body
    assert status == 200, body
    body = json.loads(body) if isinstance(body, (str, bytes)) else body
    return body["output_ids"]


def _with(sampling: dict) -> dict:
    return {**PROMPT, "sampling_params": {**PROMPT["sampling_params"], **sampling}}


def test_the_models_sampling_applies_colocated_and_across_pd(greedy_model, module_launcher):
    node = module_launcher.colocated(greedy_model, max_total_tokens=1024, num_threads=1)
    info = json.loads(http("GET", node.url + "/server_info")[2])
    assert info["default_sampling_params"] == {"temperature": 0.0, "top_p": 0.5}
    greedy = _tokens(http_post(node.url + "/generate", _with({"temperature": 0})))
    # no temperature and no seed: greedy only because the model's file says so
    assert _tokens(http_post(node.url + "/generate", PROMPT)) == greedy
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
    status, raw = http_post(node.url + "/v1/chat/completions", chat)
    assert status == 200, raw
    status, raw0 = http_post(node.url + "/v1/chat/completions", {**chat, "temperature": 0})
    assert json.loads(raw)["choices"][0]["message"] == json.loads(raw0)["choices"][0]["message"]

    pair = module_launcher.pair(greedy_model, "nixl")
    (ps, _), (ds, body) = pair.generate(PROMPT)
    assert (ps, ds) == (200, 200), body
    assert body["output_ids"] == greedy

