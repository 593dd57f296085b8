"""A node whose front end is killed outright (SIGKILL: no shutdown path runs) must not leave its
scheduler ranks running: each rank notices the front end is gone and exits."""

from __future__ import annotations

import signal

import psutil


def test_scheduler_ranks_exit_when_the_front_end_is_killed(tiny_model_dir, launcher):
    node = launcher.colocated(tiny_model_dir, tp=2, context_length=128, max_total_tokens=512,
                              env={"OMP_NUM_THREADS": "1"})
    front = psutil.Process(node.proc.pid)
    ranks = [c for c in front.children(recursive=True)
             if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
    try:
        assert len(ranks) == 2, [c.cmdline() for c in ranks]
        front.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"scheduler ranks still running after their front end died: {[p.pid for p in alive]}"
    finally:
        for p in ranks:
            if p.is_running():
                p.kill()
