"""Restarts of a cluster's children that exit after start-up (`Cluster.supervise`).

A child that exits is restarted on the same ports and command after a back-off that starts at
`backoff_initial` seconds and doubles up to `backoff_max`, at most `max_restarts` times within
`window` seconds; after that (or with restarts off) it is left down and the supervisor gives up on
it. A restarted child is reported healthy once its readiness URL answers, and after a minute of
health its back-off is short again, so an occasional crash restarts fast while a crash loop slows
down. Each event is one line (`say`) and one entry of `events`: (wall time, child name, kind,
detail) with kind exited, restarted, healthy or gave_up.

The same ports matter: the router keeps the node's URL and a prefill node's bootstrap port, so a
restarted node is back in rotation once the router's health checks pass, without a new router.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy.process import ServerProcess

HEALTHY_RESET = 60.0  # seconds of health after which the back-off starts from the beginning


@dataclass
class RestartRecord:
    """What the supervisor knows of one child."""

    backoff: float  # the wait before its next restart
    restarts: list[float] = field(default_factory=list)  # when it was restarted
    restart_at: float | None = None  # a restart is due then
    started_at: float = 0.0
    healthy_since: float | None = None
    awaiting_health: bool = False  # restarted, not ready yet
    exit_reported: bool = False  # its last exit was seen (or it was killed on purpose)
    gave_up: bool = False  # left down for good


class Supervisor:
    """One `check()` per pass over the children; `respawn(child)` starts a child again."""

    def __init__(self, *, restart: bool, max_restarts: int, window: float, backoff_initial: float,
                 backoff_max: float, respawn: Callable[[ServerProcess], None], say: Callable[[str], None]):
        self.restart, self.max_restarts, self.window = restart, max_restarts, window
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.respawn, self.say = respawn, say
        self.records: dict[str, RestartRecord] = {}
        self.events: list[tuple[float, str, str, str]] = []

    def record(self, child: ServerProcess) -> RestartRecord:
        if child.name not in self.records:
            self.records[child.name] = RestartRecord(backoff=self.backoff_initial)
        return self.records[child.name]

    def started(self, child: ServerProcess) -> None:
        """`child` was (re)started just now."""
        rec = self.record(child)
        rec.exit_reported, rec.started_at, rec.healthy_since = False, time.time(), None

    def killed(self, child: ServerProcess) -> None:
        """`child` was killed on purpose: not reported, not restarted."""
        self.record(child).exit_reported = True

    def gave_up(self, name: str) -> bool:
        return name in self.records and self.records[name].gave_up

    def _event(self, child: ServerProcess, kind: str, detail: str) -> None:
        self.events.append((time.time(), child.name, kind, detail))
        self.say(f"{time.strftime('%H:%M:%S')} {child.name}: {detail}")

    def check(self, children: list[ServerProcess], now: float | None = None) -> None:
        """One pass: note exits, restart those whose back-off is over, report the restarted ones healthy."""
        now = time.time() if now is None else now
        for c in children:
            rec = self.record(c)
            if c.proc is None or rec.gave_up:
                continue
            if c.alive():
                self._check_health(c, rec, now)
            elif rec.restart_at is None:  # just seen dead
                if not rec.exit_reported:
                    rec.exit_reported = True
                    self._exited(c, rec, now)
            elif now >= rec.restart_at:
                rec.restart_at = None
                rec.restarts.append(now)
                self.respawn(c)
                rec.awaiting_health = True
                self._event(c, "restarted", f"restarted on port {c.port} (pid {c.proc.pid})")

    def _check_health(self, c: ServerProcess, rec: RestartRecord, now: float) -> None:
        if rec.awaiting_health and c.is_ready(timeout=0.5):
            rec.awaiting_health = False
            rec.healthy_since = now
            self._event(c, "healthy", f"healthy again on port {c.port} (pid {c.proc.pid}), "
                                      f"{now - rec.started_at:.1f}s after its restart")
        if rec.healthy_since is not None and now - rec.healthy_since > HEALTHY_RESET:
            rec.backoff = self.backoff_initial

    def _exited(self, c: ServerProcess, rec: RestartRecord, now: float) -> None:
        code = c.proc.returncode
        c.group_gone()  # its scheduler ranks hold its ports
        recent = [t for t in rec.restarts if now - t < self.window]
        if not self.restart:
            self._event(c, "exited", f"exited with code {code} (restarts are off); log {c.log_path}")
            rec.gave_up = True
        elif len(recent) >= self.max_restarts:
            self._event(c, "gave_up", f"exited with code {code}; not restarted: {len(recent)} restarts in "
                                      f"the last {self.window:.0f}s (--max-restarts {self.max_restarts}); "
                                      f"log {c.log_path}")
            rec.gave_up = True
        else:
            rec.restart_at = now + rec.backoff
            self._event(c, "exited", f"exited with code {code}; restart {len(recent) + 1}/"
                                     f"{self.max_restarts} in {rec.backoff:.0f}s on port {c.port}")
            rec.backoff = min(rec.backoff * 2, self.backoff_max)
