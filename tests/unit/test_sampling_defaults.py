"""Sampling defaults: a request's left-out sampling fields get the model's generation_config values
(`--sampling-defaults model`), or the API's own (`openai`); what a request gives always wins."""

from __future__ import annotations

import json

import pytest

from common import sampling_defaults
from common.models.default_model import DEFAULT_SAMPLING, add_card_sampling
from common.openai_params import sampling_params
from common.protocol import ChatCompletionRequest, SamplingParams, convert
from common.sampling_defaults import SamplingDefaultsError, fill, from_generation_config


def test_the_sampling_fields_of_a_generation_config_are_read_and_checked():
    got = from_generation_config({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
                                  "eos_token_id": 2, "min_p": None})
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert from_generation_config({"top_k": 0}) == {"top_k": -1}  # transformers' "no top-k"
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": 2.5}, {"temperature": "hot"},
                {"repetition_penalty": 0}, {"temperature": float("nan")}, {"min_p": True}):
        with pytest.raises(SamplingDefaultsError, match=next(iter(bad))):
            from_generation_config(bad)


def test_load_follows_the_mode(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8}))
    assert sampling_defaults.load(str(tmp_path)) == {"temperature": 0.3, "top_p": 0.8}
    assert sampling_defaults.load(str(tmp_path), "openai") == {}
    assert sampling_defaults.load(str(tmp_path / "missing")) == {}
    with pytest.raises(SamplingDefaultsError, match="--sampling-defaults"):
        sampling_defaults.load(str(tmp_path), "vllm")


def _chat(**fields) -> ChatCompletionRequest:
    return convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest, "$")


def test_openai_requests_take_defaults_only_for_fields_they_leave_out():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    sp = sampling_params(_chat(), 16, defaults=defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.2, 0.9, 40, 0.05, 1.1)
    sp = sampling_params(_chat(temperature=0, top_p=1.0, top_k=0, min_p=0, repetition_penalty=1.0), 16,
                         defaults=defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.0, 1.0, -1, 0.0, 1.0)
    sp = sampling_params(_chat(), 16)  # no defaults: the API's own
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)


def test_native_sampling_params_take_defaults_for_absent_and_null_fields():
    sp = SamplingParams(temperature=0.0)
    fill(sp, ["temperature", "max_new_tokens"], {"temperature": 0.7, "top_p": 0.5})
    assert (sp.temperature, sp.top_p) == (0.0, 0.5)


def test_the_default_model_directory_gets_its_card_sampling_once(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    add_card_sampling(str(tmp_path))
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config["eos_token_id"] == 2 and all(config[k] == v for k, v in DEFAULT_SAMPLING.items())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.5}))
    add_card_sampling(str(tmp_path))  # a value already there is kept
    assert json.loads((tmp_path / "generation_config.json").read_text())["temperature"] == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generation_config.json"]


def test_the_flag_takes_the_two_modes_only():
    import argparse

    from common.config import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args([]).sampling_defaults == "model"
    assert parser.parse_args(["--sampling-defaults", "openai"]).sampling_defaults == "openai"
    with pytest.raises(SystemExit):
        parser.parse_args(["--sampling-defaults", "vllm"])
