"""`load_tokenizer` (common/server/tokenizer_load.py) gives the tokenizer `AutoTokenizer` gives, the second
time without importing torch (the class remembered per model directory and transformers version)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from common.server.tokenizer_load import _cache_path, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = "Hello world, <|im_start|> 12 345 naïve café\n\tdef f(x): return x**2"


def same(a, b) -> None:
    assert type(a) is type(b)
    assert a(TEXT)["input_ids"] == b(TEXT)["input_ids"]
    ids = a(TEXT)["input_ids"]
    assert a.decode(ids) == b.decode(ids) and a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert len(a) == len(b) and a.all_special_ids == b.all_special_ids and a.eos_token == b.eos_token
    chat = [{"role": "user", "content": "hi"}]
    if a.chat_template:
        assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_remembered_class_gives_the_same_tokenizer(tiny_model_dir, cache):
    first = load_tokenizer(tiny_model_dir)
    assert os.path.isfile(_cache_path(tiny_model_dir))
    same(AutoTokenizer.from_pretrained(tiny_model_dir), first)
    same(first, load_tokenizer(tiny_model_dir))
    code = ("import sys; from common.server.tokenizer_load import load_tokenizer; "
            f"load_tokenizer({tiny_model_dir!r}); assert 'torch' not in sys.modules, 'imported torch'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PDSERVE_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_declared_class_is_kept_and_other_files_get_their_own_entry(tiny_model_dir, tmp_path, cache):
    d = tmp_path / "qwen-tok"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    assert _cache_path(str(d)) != _cache_path(tiny_model_dir)
    want = AutoTokenizer.from_pretrained(str(d))
    load_tokenizer(str(d))
    same(want, load_tokenizer(str(d)))


def test_remote_code_is_never_cached(tiny_model_dir, tmp_path, cache):
    d = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    assert _cache_path(str(d)) is None


def test_a_copy_of_the_same_files_finds_the_same_entry(tiny_model_dir, tmp_path, cache):
    d = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, d)
    os.utime(d / "tokenizer.json", (1, 1))  # another mtime: the key is the content
    assert _cache_path(str(d)) == _cache_path(tiny_model_dir)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] += "x"
    (d / "tokenizer.json").write_text(json.dumps(tok))
    assert _cache_path(str(d)) != _cache_path(tiny_model_dir)
