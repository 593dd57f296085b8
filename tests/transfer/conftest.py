"""Fixtures for the transfer tests: a pool of long-lived rank processes and backend availability."""

from __future__ import annotations

import pytest

from tests.transfer.kv_harness import RankPool


@pytest.fixture(scope="session")
def rank_pool():
    pool = RankPool(n_prefill=2, n_decode=2)
    pool.warmed = {}
    yield pool
    pool.close()


@pytest.fixture
def warm_backend(rank_pool):
    """Build one engine of the backend in every rank process first; skip if its library is missing."""

    def warm(backend: str) -> None:
        if backend not in rank_pool.warmed:
            reports = rank_pool.warm(backend)
            bad = [r["reason"] for r in reports if not r["ok"]]
            rank_pool.warmed[backend] = bad[0] if bad else ""
        problem = rank_pool.warmed[backend]
        if problem:
            if "BackendUnavailable" in problem:
                pytest.skip(problem)
            pytest.fail(f"{backend} engine could not start: {problem}")

    return warm
