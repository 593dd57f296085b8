"""A node's run directory (`common/server/run_dir.py`): removed at a clean stop with the fork server's
socket directory, and after a crash by the next node that starts; never while its node lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common.server.run_dir import LOCK, MP_TEMP, PREFIX, sweep
from tests.harness.client import http_post

ROOT = Path(__file__).resolve().parents[2]

_HOLD = ("import sys, time\n"
         "from common.server.run_dir import RunDir\n"
         "r = RunDir(sys.argv[1])\n"
         "print(r.path, flush=True)\n"
         "time.sleep(120)\n")


def _holder(base: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(base)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def test_a_run_directory_is_swept_only_once_its_owner_is_gone(tmp_path):
    live, live_dir = _holder(tmp_path)
    dead, dead_dir = _holder(tmp_path)
    try:
        assert Path(live_dir, LOCK).is_file() and oct(os.stat(live_dir).st_mode & 0o777) == "0o700"
        assert sweep(str(tmp_path)) == []  # both owners alive
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert sweep(str(tmp_path)) == [dead_dir]
        assert not os.path.exists(dead_dir) and os.path.isdir(live_dir)
    finally:
        for p in (live, dead):
            p.kill()
            p.wait(10)
            p.stdout.close()


def test_the_sweep_leaves_what_is_not_a_dead_nodes_own(tmp_path):
    unlocked = tmp_path / f"{PREFIX}creating"  # no lock file yet (or an older version's)
    unlocked.mkdir()
    foreign = tmp_path / f"{PREFIX}someone-else"
    foreign.mkdir()
    (foreign / LOCK).touch()
    os.chown(foreign, 65534, 65534)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / LOCK).touch()
    (tmp_path / f"{PREFIX}link").symlink_to(target)
    assert sweep(str(tmp_path)) == []
    assert unlocked.is_dir() and foreign.is_dir() and (target / LOCK).is_file()


def test_a_dead_nodes_fork_server_directory_goes_with_it_and_nothing_outside_the_temp_dir(tmp_path):
    mp_dir = tempfile.mkdtemp(prefix="pymp-")
    outside = tmp_path / "pymp-outside"
    outside.mkdir()
    for name, path in (("a", mp_dir), ("b", str(outside))):
        d = tmp_path / f"{PREFIX}{name}"
        d.mkdir()
        (d / LOCK).touch()
        (d / MP_TEMP).write_text(path)
    assert len(sweep(str(tmp_path))) == 2
    assert not os.path.exists(mp_dir)
    assert outside.is_dir()  # not in the temp directory: not a fork server's


def test_a_clean_stop_leaves_nothing_and_a_crash_is_cleared_by_the_next_node(tiny_model_dir, launcher):
    def run_dirs(node) -> tuple[str, str]:
        lock = next(t for t in (os.readlink(f"/proc/{node.proc.pid}/fd/{fd}")
                                for fd in os.listdir(f"/proc/{node.proc.pid}/fd")) if t.endswith("/" + LOCK))
        run = os.path.dirname(lock)
        return run, Path(run, MP_TEMP).read_text()

    crashed = launcher.colocated(tiny_model_dir, tp=2)
    run_a, mp_a = run_dirs(crashed)
    assert os.path.basename(mp_a).startswith("pymp-") and os.path.isdir(mp_a)
    crashed.kill()  # SIGKILL: nothing of the node can clean up
    assert os.path.isdir(run_a) and os.path.isdir(mp_a)

    node = launcher.colocated(tiny_model_dir, tp=2)
    assert not os.path.exists(run_a) and not os.path.exists(mp_a)
    # (the new node's sweep removed them, or one a parallel test started first did)
    run_b, mp_b = run_dirs(node)
    status, body = http_post(f"{node.url}/generate",
                             {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, body
    node.stop()
    assert not os.path.exists(run_b) and not os.path.exists(mp_b)
