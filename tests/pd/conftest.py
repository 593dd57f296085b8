"""Fixtures for the PD node tests: the tiny model, its tokenizer and a colocated reference node
(helpers live in tests/harness/pd.py)."""

from __future__ import annotations

import pytest

from tests.harness.pd import BASE, FAST_ENV


@pytest.fixture(scope="session")
def pd_model_dir(tiny_model_dir) -> str:
    """The shared tiny random-weight llama of tests/conftest.py."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def pd_tok(pd_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pd_model_dir)


@pytest.fixture(scope="session")
def colocated(pd_model_dir, session_launcher):
    """A colocated node (`pdserve serve`) with the same settings: the reference answers."""
    return session_launcher.colocated(pd_model_dir, env=FAST_ENV, **BASE)
