"""Sampling defaults: what a request that leaves a sampling field out gets.

A model's `generation_config.json` may say how it is meant to be sampled (`temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty`). With `--sampling-defaults model` (the default, as SGLang's flag of that name
and vLLM's `--generation-config auto`) a node fills every one of those fields a request leaves out from
the model's file; a field the request gives always wins. With `--sampling-defaults openai` the file is
ignored and the API's own defaults apply (temperature 1.0, top_p 1.0, no top_k or min_p, no penalty).
`do_sample` is not read: a model that lists a temperature is sampled at it, as the other servers do;
`temperature: 0` in a request still asks for greedy decoding.

Prefill and decode nodes of one pool read the same model directory, so both legs of a disaggregated
request, the prefill node's first token included, are sampled alike; `/server_info` shows the values in
effect as `default_sampling_params`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("model", "openai")
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class SamplingDefaultsError(ValueError):
    """generation_config.json holds a sampling value no request could ask for."""


def _checked(name: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingDefaultsError(f"generation_config.json: {name} must be a number, got {value!r}")
    if name == "top_k":
        if value != int(value) or value < 0:
            raise SamplingDefaultsError("generation_config.json: top_k must be an integer >= 0, got "
                                        f"{value!r}")
        return int(value) if value > 0 else -1  # transformers' 0: no top-k
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
          "repetition_penalty": value > 0}[name]
    if not ok:
        raise SamplingDefaultsError(f"generation_config.json: {name} = {value!r} is out of range")
    return float(value)


def from_generation_config(config: dict[str, Any]) -> dict[str, float | int]:
    """The sampling fields a generation config sets, checked and in SamplingParams' terms."""
    return {name: _checked(name, config[name]) for name in FIELDS if config.get(name) is not None}


def load(model_dir: str, mode: str = "model") -> dict[str, float | int]:
    """The defaults a node serving `model_dir` applies under `mode` (empty: the API's own)."""
    if mode not in MODES:
        raise SamplingDefaultsError(f"--sampling-defaults must be one of {', '.join(MODES)}, got {mode!r}")
    path = os.path.join(model_dir, "generation_config.json")
    if mode == "openai" or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return from_generation_config(config if isinstance(config, dict) else {})


def fill(sp, given: Iterable[str], defaults: dict[str, float | int]) -> None:
    """Set each default on `sp` (a SamplingParams) whose field is not among `given`."""
    given = set(given)
    for name, value in defaults.items():
        if name not in given:
            setattr(sp, name, value)


def describe(defaults: dict[str, float | int]) -> str:
    return " ".join(f"{k}={v}" for k, v in defaults.items()) or "the API's own (none in the model's files)"
