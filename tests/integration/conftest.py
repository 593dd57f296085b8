"""Fixtures of the integration suite: real clusters (router + prefill + decode processes on 127.0.0.1,
`Launcher.cluster` of tests/harness/nodes.py), serving the tiny random model."""

from __future__ import annotations

import pytest

from tests.harness.cluster import cluster_pools, wait_pools


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
