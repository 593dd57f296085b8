"""Fixtures for the PD node tests: the tiny model, its tokenizer and a colocated reference node
(helpers live in pd_harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pd_harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # node_process
from node_process import NodeProcess  # noqa: E402
from pd_harness import BASE, FAST_ENV  # noqa: E402


@pytest.fixture(scope="session")
def pd_model_dir(tiny_model_dir) -> str:
    """The shared tiny random-weight llama of tests/conftest.py."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def pd_tok(pd_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pd_model_dir)


@pytest.fixture(scope="session")
def colocated(pd_model_dir):
    """A colocated node (`pdserve serve`) with the same settings: the reference answers."""
    node = NodeProcess(pd_model_dir, env=FAST_ENV, **BASE)
    node.start()
    yield node
    node.stop()
