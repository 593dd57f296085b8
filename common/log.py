"""One logging set-up for every process: one line per event, with the role and pid."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(role: str, level: str = "info") -> logging.Logger:
    """Configure the root logger for this process; returns the role's logger."""
    fmt = f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(role)


def exit_now(code: int) -> None:
    """End a process that has closed what it owns: logs and stdio flushed, the interpreter's teardown of
    torch and the other native modules skipped (up to a second, on every stop of a node)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
