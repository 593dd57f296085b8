"""A node whose front end is killed outright (SIGKILL: no shutdown path runs) must not leave its
scheduler ranks running: each rank notices the front end is gone and exits. A node of several ranks
starts them from a fork server (`common/server/launch.py: rank_context`), so a rank's parent is that
server, not the front end: the rank watches the front end's pid itself (`ProcessWatch`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from common.scheduler.process import ProcessWatch
from tests.harness.nodes import thread_names


def test_scheduler_ranks_and_their_fork_server_exit_when_the_front_end_is_killed(tiny_model_dir, launcher):
    node = launcher.colocated(tiny_model_dir, tp=2, context_length=128, max_total_tokens=512,
                              env={"OMP_NUM_THREADS": "1"})
    front = psutil.Process(node.proc.pid)
    servers = [c for c in front.children() if "forkserver" in " ".join(c.cmdline())]
    ranks = [c for s in servers for c in s.children()]
    try:
        assert len(servers) == 1 and len(ranks) == 2, [c.cmdline() for c in front.children(recursive=True)]
        # two ranks reduce over gloo (a single rank joins no group: tests/integration/test_server_api.py)
        assert all("gloo_tcp_loop" in thread_names(r.pid) for r in ranks)
        front.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks + servers, timeout=60)
        assert not alive, f"processes still running after their front end died: {[p.pid for p in alive]}"
    finally:
        for p in ranks + servers:
            if p.is_running():
                p.kill()


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_process_watch_sees_the_end_of_a_process_that_is_not_its_parent(pidfd, monkeypatch):
    if not pidfd:  # a kernel before 5.3
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(38, "no pidfd_open")))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = ProcessWatch(other.pid)
        assert not watch.gone()
        other.kill()
        other.wait(10)
        assert watch.gone()
        assert watch.gone()  # stays gone
    finally:
        other.kill()
    assert ProcessWatch(other.pid).gone()  # reaped: no such process any more
