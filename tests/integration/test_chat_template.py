"""Chat templates: a model without one answers chat requests with a 400 that says what to do (no made-up
transcript), and `--chat-template FILE` renders chat with the given template instead of the model's."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from common.config import ConfigError, ServerArgs
from tests.harness.client import http_post

TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>"


@pytest.fixture(scope="module")
def no_template_model(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_model_dir, out)
    if os.path.exists(out / "chat_template.jinja"):
        os.remove(out / "chat_template.jinja")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def chat(node, content="hi"):
    return http_post(node.url + "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})


def test_a_model_without_a_template_refuses_chat_and_says_why(no_template_model, module_launcher):
    node = module_launcher.colocated(no_template_model, max_total_tokens=1024, num_threads=1)
    status, raw = chat(node)
    assert status == 400, raw
    assert "no chat template; start the node with --chat-template FILE" in json.loads(raw)["error"]["message"]
    assert http_post(node.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_chat_template_file_renders_chat(no_template_model, module_launcher, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    node = module_launcher.colocated(no_template_model, chat_template=str(path), max_total_tokens=1024,
                                     num_threads=1)
    content = "the quick brown fox"
    status, raw = chat(node, content)
    assert status == 200, raw
    tok = AutoTokenizer.from_pretrained(no_template_model)
    want = tok.encode(f"<<user>> {content}\n<<assistant>>", add_special_tokens=False)
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(want)


def test_chat_template_must_be_a_file(tiny_model_dir):
    with pytest.raises(ConfigError, match="--chat-template: no such file"):
        ServerArgs(model=tiny_model_dir, chat_template="/no/such.jinja").validate()
