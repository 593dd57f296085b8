"""How a node starts its scheduler ranks (`common/server/launch.py`): one rank is spawned, several fork
from a fork server (the orphan test, tests/integration/test_orphan_scheduler.py, runs such a node); a rank
that cannot be started ends the launch with a LaunchError naming why, and the ranks started before it
are listed so the launch stops them."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest

from common.server import launch


def test_one_rank_is_spawned_several_fork_from_a_server():
    assert launch.rank_context(1, None).get_start_method() == "spawn"
    assert launch.rank_context(2, None).get_start_method() == "forkserver"


class _Ctx:
    """A start method whose second process cannot start."""

    def __init__(self):
        self.started = 0
        self.real = mp.get_context("spawn")

    def Pipe(self, duplex):  # noqa: N802 (multiprocessing's name)
        return self.real.Pipe(duplex=duplex)

    def Process(self, **kw):  # noqa: N802
        ctx = self

        class P:
            pid = 4242

            def start(self):
                if ctx.started == 1:
                    raise OSError("Resource temporarily unavailable")
                ctx.started += 1

        return P()


def test_a_rank_that_cannot_start_is_a_launch_error_naming_the_cause():
    args = SimpleNamespace(dp_size=1, tp=2, pp_size=1)
    starter = launch.RankStarter(args, "/nonexistent", [SimpleNamespace()], None, _Ctx())
    starter.start()
    with pytest.raises(launch.LaunchError,
                       match="cannot start the scheduler ranks: OSError: Resource temporarily"):
        starter.finish()
    assert starter.names == ["scheduler rank 0"] and len(starter.procs) == 1  # the one to stop
    starter.finish()  # reported once
