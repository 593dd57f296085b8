"""Fixtures of the integration suite: real clusters (router + prefill + decode processes on 127.0.0.1)
started by `deploy.cluster.Cluster`, serving the tiny random model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_utils import cluster_pools, make_cluster, wait_pools  # noqa: E402


@pytest.fixture(scope="session")
def fake_cluster(tiny_model_dir, tmp_path_factory):
    """Router + 2 prefill + 2 decode with the fake transfer backend, shared by the scenario tests."""
    c = make_cluster(tiny_model_dir, tmp_path_factory.mktemp("cluster-fake"))
    c.start()
    c.baseline = cluster_pools(c)
    yield c
    c.stop()


@pytest.fixture
def pools_restored(fake_cluster):
    """After the test: every surviving node's pools are back at the cluster's starting figures."""
    yield fake_cluster
    wait_pools(fake_cluster, fake_cluster.baseline)
