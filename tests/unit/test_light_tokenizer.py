"""`LightTokenizer` (common/server/light_tokenizer.py) and `render_chat` (common/server/chat_template.py)
answer as transformers' tokenizer does, and `light_mismatch` (common/server/tokenizer_load.py) tells when
they do not."""

from __future__ import annotations

import json
import os
import shutil

import jinja2
import pytest
from transformers import AutoTokenizer

from common.server.chat_template import render_chat
from common.server.light_tokenizer import LightTokenizer
from common.server.tokenizer_load import PROBE_TOOLS, light_mismatch

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_TEXT_ARGS = {"id": "c2", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
USER = {"role": "user", "content": "What's the weather?"}
# (messages, tools, add_generation_prompt, continue_final_message, variables)
CONVERSATIONS = [
    ([USER], None, True, False, {}),
    ([USER], None, False, False, {}),
    ([{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Sunny."}, USER],
     None, True, False, {}),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL, CALL_TEXT_ARGS]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], PROBE_TOOLS, True, False, {}),
    ([USER, {"role": "assistant", "content": "It is", "reasoning_content": " Look it up. "}],
     None, False, True, {}),
    ([USER, {"role": "assistant", "content": "It is", "reasoning": "Look it up."}], None, False, False, {}),
    ([USER, {"role": "assistant", "content": "It is", "thinking": "Look it up."}, USER],
     None, True, False, {}),
    ([USER, {"role": "assistant", "content": "Ends in spaces   "}], None, False, True, {}),
    ([USER,
      {"role": "assistant", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "list"}]}],
     None, False, True, {}),
    ([{"role": "user",
       "content": [{"type": "text", "text": "parts"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     None, True, False, {}),
    ([USER], PROBE_TOOLS, True, False, {"enable_thinking": False}),
    ([USER], None, True, False, {"bos_token": "<override>"}),
    ([{"role": "narrator", "content": "x"}], None, True, False, {}),
    ([USER, {"role": "assistant"}], None, False, True, {}),
    ([], None, True, False, {}),
]


def _templates(model_dir: str) -> dict[str, str]:
    out = {"model": open(os.path.join(model_dir, "chat_template.jinja")).read()}
    for name in ("chatml_tools.jinja", "reasoning_tools.jinja"):
        with open(os.path.join(DATA, name)) as f:
            out[name] = f.read()
    return out


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - which inputs are refused is what is compared
        return f"refused ({type(e).__name__})"


@pytest.mark.parametrize("name", ["model", "chatml_tools.jinja", "reasoning_tools.jinja"])
def test_chat_templates_render_as_in_transformers(tiny_model_dir, name):
    template = _templates(tiny_model_dir)[name]
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.chat_template = template
    light = LightTokenizer.open(tiny_model_dir)
    light.chat_template = template
    rendered = 0
    for messages, tools, gen, cont, variables in CONVERSATIONS:
        kw = dict(tools=tools, add_generation_prompt=gen, continue_final_message=cont,
                  tokenize=False, **variables)
        want = _outcome(hf.apply_chat_template, messages, **kw)
        got = _outcome(light.apply_chat_template, messages, **kw)
        if isinstance(want, str) and want.startswith("refused"):
            assert got.startswith("refused"), (messages, got)
        else:
            assert got == want, messages
            rendered += 1
    assert rendered >= 8
    assert light_mismatch(hf, light) is None


def test_the_rich_template_takes_each_path(tiny_model_dir):
    """The comparison above means something only if the template reaches what it tests."""
    template = _templates(tiny_model_dir)["reasoning_tools.jinja"]
    light = LightTokenizer.open(tiny_model_dir)
    light.chat_template = template
    text = light.apply_chat_template(CONVERSATIONS[3][0], tools=PROBE_TOOLS, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '"arguments": {"city": "Rome"}' in text and "<tool_response>sunny</tool_response>" in text
    assert "# Tools (today is 4 digits of a year)" in text and text.startswith("<|im_start|>")
    cont = light.apply_chat_template(CONVERSATIONS[4][0], continue_final_message=True)
    assert cont.endswith("<think>\nLook it up.\n</think>\n\nIt is")
    assert "<think>\nLook it up." in light.apply_chat_template(CONVERSATIONS[5][0])
    assert light.apply_chat_template(CONVERSATIONS[8][0], continue_final_message=True).endswith("a list")
    assert light.apply_chat_template(CONVERSATIONS[7][0],
                                     continue_final_message=True).endswith("Ends in spaces   ")
    with pytest.raises(jinja2.TemplateError, match="unknown role narrator"):
        light.apply_chat_template(CONVERSATIONS[12][0])


@pytest.mark.parametrize("template, error", [
    ("{% set ns = namespace() %}{% set ns._hidden = 1 %}", jinja2.exceptions.SecurityError),
    ("{{ namespace(_x=1) }}", jinja2.exceptions.SecurityError),
    ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),
    ("{{ ().__class__.__base__.__subclasses__() }}", jinja2.exceptions.SecurityError),
    ("{{ raise_exception('no') }}", jinja2.exceptions.TemplateError),
])
def test_the_sandbox_refuses_what_a_template_must_not_do(template, error):
    with pytest.raises(error):
        render_chat(template, [USER])


def test_tojson_keeps_text_as_is():
    assert render_chat("{{ messages[0].content | "
                       "tojson }}", [{"role": "user", "content": "é <b>"}]) == '"é <b>"'


def test_light_mismatch_names_what_differs(tiny_model_dir, tmp_path):
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert light_mismatch(hf, LightTokenizer.open(tiny_model_dir)) is None
    light = LightTokenizer.open(tiny_model_dir)
    light.chat_template += " "
    assert light_mismatch(hf, light) == "the chat template"
    light = LightTokenizer.open(tiny_model_dir)
    light.special_tokens_map = {**light.special_tokens_map, "bos_token": "<|endoftext|>"}
    assert light_mismatch(hf, light) == "the special tokens' names"
    light = LightTokenizer.open(tiny_model_dir)
    light.backend_tokenizer.add_special_tokens(["<extra>"])
    assert light_mismatch(hf, light) == "the backend tokenizer differs from tokenizer.json"
    light = LightTokenizer.open(tiny_model_dir)
    light.decode = lambda ids, skip_special_tokens=False: "x"
    assert light_mismatch(hf, light).startswith("decode of")
    d = tmp_path / "qwen2-class"  # a class that builds its own backend from the vocabulary
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    assert light_mismatch(AutoTokenizer.from_pretrained(str(d)), LightTokenizer.open(str(d))) is not None


def test_open_declines_what_it_cannot_read_alike(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    assert LightTokenizer.open(str(d)) is None
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "additional_chat_templates").mkdir()
    assert LightTokenizer.open(str(d)) is None
    shutil.rmtree(d / "additional_chat_templates")
    os.remove(d / "tokenizer.json")
    assert LightTokenizer.open(str(d)) is None


def test_named_templates_give_the_default_and_keep_a_node_on_transformers(tiny_model_dir, tmp_path):
    d = tmp_path / "named"
    shutil.copytree(tiny_model_dir, d)
    os.remove(d / "chat_template.jinja")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": "{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named}))
    light = LightTokenizer.open(str(d))
    assert light.apply_chat_template([USER]) == USER["content"]
    hf = AutoTokenizer.from_pretrained(str(d))
    assert hf.apply_chat_template([USER], tokenize=False) == USER["content"]
    assert light_mismatch(hf, light) == "the chat template"


def test_a_long_text_is_tokenized_without_stopping_the_event_loop(tiny_model_dir):
    """The front end tokenizes a long prompt on its pool; the event loop must keep serving meanwhile (as
    transformers' tokenizer lets it: `tests/integration/test_backpressure.py` checks /health on a node)."""
    import asyncio
    import time
    from concurrent.futures import ThreadPoolExecutor

    light = LightTokenizer.open(tiny_model_dir)
    text = "lorem ipsum dolor sit amet " * 75_000

    async def ticks_while(fn, *args) -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            job = loop.run_in_executor(pool, fn, *args)
            ticks = 0
            while not job.done():
                await asyncio.sleep(0.005)
                ticks += 1
            return ticks, time.monotonic() - t0, await job

    ticks, secs, ids = asyncio.run(ticks_while(light.encode, text))
    assert len(ids) > 100_000 and secs > 0.2, secs
    assert ticks >= 10, (ticks, secs)  # a held GIL gives 1-2 ticks whatever the time
