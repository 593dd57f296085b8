"""Fixtures of the integration suite: real clusters (router + prefill + decode processes on 127.0.0.1,
`Launcher.cluster` of tests/harness/nodes.py), serving the tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.cluster import NODE_SETTINGS, cluster_pools, wait_pools

# nodes whose chat template takes tools (tests/integration/test_openai_features.py)
TOOLS_TEMPLATE = str(Path(__file__).resolve().parent.parent / "data" / "chatml_tools.jinja")
SETTINGS = {**NODE_SETTINGS, "chat_template": TOOLS_TEMPLATE}


@pytest.fixture(scope="session")
def fake_cluster(tiny_model_dir, session_launcher):
    """Router + 2 prefill + 2 decode with the fake transfer backend, shared by the scenario tests."""
    c = session_launcher.cluster(tiny_model_dir, backend="fake")
    c.baseline = cluster_pools(c)
    return c


@pytest.fixture
def pools_restored(fake_cluster):
    """After the test: every surviving node's pools are back at the cluster's starting figures."""
    yield fake_cluster
    wait_pools(fake_cluster, fake_cluster.baseline)


@pytest.fixture(scope="session")
def colocated(tiny_model_dir, session_launcher):
    """One colocated node with the cluster settings (and a tools template): the reference answers."""
    return session_launcher.colocated(tiny_model_dir, **SETTINGS)


@pytest.fixture(scope="session")
def mooncake_cluster(tiny_model_dir, session_launcher):
    """Router + 1 prefill + 1 decode moving the KV with mooncake over TCP: answers must equal
    `colocated`'s."""
    c = session_launcher.cluster(tiny_model_dir, backend="mooncake", prefill=1,
                                 decode=1, node_settings=SETTINGS,
                                 role_env={r: {"PDSERVE_TRANSFER_PROTOCOL": "tcp"}
                                           for r in ("prefill", "decode")})
    c.baseline = cluster_pools(c)
    return c


@pytest.fixture(scope="module")
def mooncake_pd(mooncake_cluster):
    """`mooncake_cluster` for one module: after the module every room, page and slot is back."""
    yield mooncake_cluster
    wait_pools(mooncake_cluster, mooncake_cluster.baseline)
