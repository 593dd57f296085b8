"""`load_tokenizer` (common/server/tokenizer_load.py): the first start with a tokenizer loads transformers'
and checks the light one against it; later starts read the light one without importing transformers, or
transformers' class without `AutoTokenizer` (and without torch) when the light one differs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from common.server.light_tokenizer import LightTokenizer
from common.server.tokenizer_load import cache_path, light_mismatch, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(ROOT, "tests", "data", "chatml_tools.jinja")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fresh_start(model_dir: str, cache, template: str | None = None) -> dict:
    """What a new process (a node's front end) loads, and which modules that imported."""
    code = ("import json, sys; from common.server.tokenizer_load import load_tokenizer; "
            f"t = load_tokenizer({model_dir!r}, {template!r}); "
            "print(json.dumps([type(t).__name__, 'transformers' in sys.modules, 'torch' in sys.modules, "
            "t.chat_template]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PDSERVE_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    name, transformers, torch, template = json.loads(out.stdout.strip().splitlines()[-1])
    return {"class": name, "transformers": transformers, "torch": torch, "template": template}


def test_a_checked_tokenizer_is_read_without_transformers_afterwards(tiny_model_dir, cache):
    first = load_tokenizer(tiny_model_dir)
    assert type(first).__name__ == "TokenizersBackend"
    with open(cache_path(tiny_model_dir, None)) as f:
        assert json.load(f)["light"] is True
    second = load_tokenizer(tiny_model_dir)
    assert isinstance(second, LightTokenizer) and light_mismatch(first, second) is None
    assert _fresh_start(tiny_model_dir, cache) == {"class": "LightTokenizer",
                                                   "transformers": False, "torch": False,
                                                   "template": first.chat_template}


def test_a_chat_template_file_gets_its_own_check(tiny_model_dir, cache):
    with open(TEMPLATE) as f:
        template = f.read()
    assert cache_path(tiny_model_dir, template) != cache_path(tiny_model_dir, None)
    first = load_tokenizer(tiny_model_dir, template)
    assert first.chat_template == template and not isinstance(first, LightTokenizer)
    started = _fresh_start(tiny_model_dir, cache, template)
    assert started["class"] == "LightTokenizer" and started["template"] == template \
        and not started["transformers"]


def test_a_tokenizer_the_light_one_differs_from_keeps_transformers_class(tiny_model_dir, tmp_path, cache):
    d = tmp_path / "qwen-tok"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    assert cache_path(str(d), None) != cache_path(tiny_model_dir, None)
    want = AutoTokenizer.from_pretrained(str(d))
    load_tokenizer(str(d))
    with open(cache_path(str(d), None)) as f:
        assert json.load(f) == {"class": "Qwen2Tokenizer", "path": os.path.realpath(d), "light": False}
    again = load_tokenizer(str(d))
    assert type(again) is type(want) and again.encode("Hello world") == want.encode("Hello world")
    assert _fresh_start(str(d), cache) == {"class": "Qwen2Tokenizer", "transformers": True, "torch": False,
                                           "template": want.chat_template}


def test_an_entry_from_before_the_check_is_checked_once(tiny_model_dir, cache):
    path = cache_path(tiny_model_dir, None)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"class": "TokenizersBackend", "path": tiny_model_dir}, f)
    assert type(load_tokenizer(tiny_model_dir)).__name__ == "TokenizersBackend"
    with open(path) as f:
        assert json.load(f)["light"] is True
    assert isinstance(load_tokenizer(tiny_model_dir), LightTokenizer)


def test_remote_code_is_never_cached(tiny_model_dir, tmp_path, cache):
    d = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg,
                                                         "auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    assert cache_path(str(d), None) is None


def test_a_copy_of_the_same_files_finds_the_same_entry(tiny_model_dir, tmp_path, cache):
    d = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, d)
    os.utime(d / "tokenizer.json", (1, 1))  # another mtime: the key is the content
    assert cache_path(str(d), None) == cache_path(tiny_model_dir, None)
    (d / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert cache_path(str(d), None) != cache_path(tiny_model_dir, None)
    shutil.copy(os.path.join(tiny_model_dir, "chat_template.jinja"), d / "chat_template.jinja")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] += "x"
    (d / "tokenizer.json").write_text(json.dumps(tok))
    assert cache_path(str(d), None) != cache_path(tiny_model_dir, None)


def test_a_check_that_raises_keeps_transformers_tokenizer(tiny_model_dir, cache, monkeypatch):
    import common.server.tokenizer_load as tl

    def broken(hf, light):
        raise RuntimeError("boom")

    monkeypatch.setattr(tl, "light_mismatch", broken)
    assert type(load_tokenizer(tiny_model_dir)).__name__ == "TokenizersBackend"
    with open(cache_path(tiny_model_dir, None)) as f:
        assert json.load(f)["light"] is False
    assert type(load_tokenizer(tiny_model_dir)).__name__ == "TokenizersBackend"
