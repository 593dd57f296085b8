"""The scheduler watchdog (`--watchdog-timeout`): a rank whose loop stops making progress ends.

The scheduler loop calls `beat()` once per iteration; an idle loop still iterates every poll
timeout, so a silent counter means the loop is stuck: in a forward, a collective whose peer rank
hangs, or a lock. A daemon thread checks the counter; after `timeout` seconds without a beat it
logs every thread's stack (one block, so the log shows where each thread is), then ends the process
with `EXIT_CODE`. The node's front end watches its ranks: it sees the exit code, answers 503 on
`/health` and fails every live request with a reason naming the watchdog
(`common/server/launch.py`). Ending the process is the only safe move: a stuck forward cannot be
interrupted from Python, and the rank's memory may be in any state.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

logger = logging.getLogger("watchdog")

EXIT_CODE = 86  # a scheduler rank ended by its watchdog


def describe_exit(code: int | None, timeout: float) -> str | None:
    """The front end's words for a rank that ended with `code`, if the watchdog ended it."""
    if code == EXIT_CODE:
        return (f"made no progress for {timeout:g}s (--watchdog-timeout) and was stopped; its log holds "
                "every thread's stack")
    return None


def thread_stacks() -> str:
    """Every thread's current stack, each under its name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    def __init__(self, timeout: float, name: str, on_stuck=None) -> None:
        self.timeout = timeout
        self.name = name
        self.beats = 0
        self._on_stuck = on_stuck or self._exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.beats += 1  # one writer (the loop); the checker only compares values

    def start(self) -> Watchdog:
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        seen, since = self.beats, time.monotonic()
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            if self.beats != seen:
                seen, since = self.beats, now
            elif now - since >= self.timeout:
                logger.error("%s: no loop iteration for %.0fs (--watchdog-timeout %g); thread stacks:\n%s",
                             self.name, now - since, self.timeout, thread_stacks())
                self._on_stuck()
                return

    @staticmethod
    def _exit() -> None:
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(EXIT_CODE)
