"""A node's private run directory, and the sweep that removes the ones crashed nodes left behind.

The front end and its scheduler ranks meet through files no other user may open: the two ZMQ ipc
sockets and the torch.distributed rendezvous file live in a fresh `pdserve-ipc-*` directory of mode
0700 under the temp directory (a socket file's own mode is not what guards it: its directory's is).
A multi-rank node's fork server also puts its socket in a directory of its own (multiprocessing's
`pymp-*`), which the interpreter removes only at a normal exit, and a node ends with `os._exit`.

A clean stop removes both (`RunDir.remove`). A node killed with SIGKILL cannot, so each run directory
holds `owner.lock`, which its front end holds an exclusive `flock` on for its whole life; the kernel
drops that lock however the process ends. Every node that starts removes the run directories of this
user whose lock it can take (their owner is gone), with the fork-server directory each one names in
`mp_temp_dir`. The lock file is locked before it gets its name, so a directory being created is never
taken for a dead one.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import multiprocessing.util
import os
import shutil
import stat
import tempfile

logger = logging.getLogger("server")

PREFIX = "pdserve-ipc-"
LOCK = "owner.lock"
MP_TEMP = "mp_temp_dir"  # the path of the front end's multiprocessing temp directory, when it has one


def _mine(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not stat.S_ISLNK(st.st_mode)


def _remove_mp_temp(run_dir: str) -> None:
    """Remove the multiprocessing temp directory `run_dir` names, if it is one of this user's."""
    try:
        with open(os.path.join(run_dir, MP_TEMP)) as f:
            path = f.read().strip()
    except OSError:
        return
    parent = os.path.realpath(tempfile.gettempdir())
    if (os.path.dirname(os.path.realpath(path)) == parent and os.path.basename(path).startswith("pymp-")
            and _mine(path)):
        shutil.rmtree(path, ignore_errors=True)


def sweep(base: str | None = None) -> list[str]:
    """Remove this user's run directories under `base` (the temp directory) whose owner is gone; returns
    them. A directory without a lock file (still being created, or from an older version) is left."""
    removed = []
    for path in glob.glob(os.path.join(base or tempfile.gettempdir(), PREFIX + "*")):
        if not _mine(path):
            continue
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its node is alive
            os.close(fd)
            continue
        try:
            _remove_mp_temp(path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d run directories of nodes that are gone: %s", len(removed), ", ".join(removed))
    return removed


class RunDir:
    """A fresh run directory, locked by this process until `remove()` (or its end)."""

    def __init__(self, base: str | None = None) -> None:
        sweep(base)
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
        os.chmod(self.path, 0o700)  # mkdtemp's mode already; stated, since the sockets rely on it
        pending = os.path.join(self.path, ".owner")
        self._fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        os.rename(pending, os.path.join(self.path, LOCK))

    def note_mp_temp_dir(self) -> None:
        """Record this process's multiprocessing temp directory (a fork server's socket is in it), so a
        sweep after a crash removes it too; `remove()` removes it."""
        with open(os.path.join(self.path, MP_TEMP), "w") as f:
            f.write(multiprocessing.util.get_temp_dir())

    def remove(self) -> None:
        _remove_mp_temp(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
