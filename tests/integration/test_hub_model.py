"""Hugging Face Hub model ids: `--model owner/name` resolves through the Hub cache (here a cache laid out as
huggingface_hub writes it, read offline: this machine has no Hub), `--revision` picks a tag or commit, and
what cannot be resolved is an error naming the flag. A real node serves a Hub id under that id."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from common.config import ConfigError, ServerArgs
from common.models.hub import HubError, is_hub_id, resolve_hub_model
from tests.harness.client import get_json, http_post

MAIN, TAGGED = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir, tmp_path_factory):
    """HF_HUB_CACHE with acme/tiny: `main` at one commit, tag `v2` at another whose config differs."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--acme--tiny"
    for commit in (MAIN, TAGGED):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    cfg_path = repo / "snapshots" / TAGGED / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pdserve_test_revision"] = "v2"
    cfg_path.write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(TAGGED)
    return str(root)


@pytest.fixture
def offline(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache)
    return hub_cache


def test_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for not_an_id in ("default", "model.gguf", "a/b/c", "/abs/dir", "../x", "a/..", "-a/b", "a/b-", " a/b"):
        assert not is_hub_id(not_an_id), not_an_id
    monkeypatch.chdir(tmp_path)
    os.makedirs("acme/tiny")
    assert not is_hub_id("acme/tiny")  # a directory that exists is a path


def test_resolves_main_a_tag_and_a_commit_from_the_cache(offline):
    main = resolve_hub_model("acme/tiny")
    assert main == os.path.join(offline, "models--acme--tiny", "snapshots", MAIN)
    tagged = resolve_hub_model("acme/tiny", "v2")
    assert json.load(open(os.path.join(tagged, "config.json")))["pdserve_test_revision"] == "v2"
    assert resolve_hub_model("acme/tiny", TAGGED) == tagged


def test_what_cannot_be_resolved_names_the_flag(offline):
    with pytest.raises(HubError,
                       match=r"--model: acme/missing is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_hub_model("acme/missing")
    with pytest.raises(HubError, match=r"(--revision|--model).*nope"):
        resolve_hub_model("acme/tiny", "nope")


def test_revision_needs_a_hub_id(tiny_model_dir):
    ServerArgs(model="acme/tiny", revision="v2").validate()
    with pytest.raises(ConfigError, match="--revision: applies to a Hugging Face Hub model id"):
        ServerArgs(model=tiny_model_dir, revision="v2").validate()
    with pytest.raises(ConfigError, match="--model: no such model directory or file, and not a Hugging Face"):
        ServerArgs(model="/no/such/dir").validate()


def test_a_node_serves_a_hub_id_under_that_id(hub_cache, module_launcher):
    env = {"HF_HUB_CACHE": hub_cache, "HF_HUB_OFFLINE": "1"}
    node = module_launcher.colocated("acme/tiny", revision="v2", env=env,
                                     max_total_tokens=1024, num_threads=1)
    assert get_json(node.url + "/v1/models")["data"][0]["id"] == "acme/tiny"
    info = get_json(node.url + "/server_info")
    assert info["model_path"].endswith(os.path.join("snapshots", TAGGED))
    status, body = http_post(node.url + "/generate",
                             {"text": "hello", "sampling_params": {"max_new_tokens": 3}})
    assert status == 200, body


def test_a_node_with_an_id_missing_from_the_cache_exits_with_the_reason(hub_cache):
    script = ("from common.config import ServerArgs\nfrom common.server.launch import launch_server\n"
              "launch_server(ServerArgs(model='acme/missing', port=1))\n")
    env = {**os.environ, "HF_HUB_CACHE": hub_cache, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--model: acme/missing is not in the Hugging Face cache" in done.stderr
