"""Liveness: which watched peers have been silent for longer than the heartbeat window.

A manager's timer calls `check(live, now)` every tick with the peers that have live rooms with it;
its control plane calls `heard(addr, now)` for every message. A peer is watched from the first check
that names it until a check leaves it out (its rooms ended) or `forget(addr)`; it is dead once
`now - max(watched since, last heard)` exceeds the window.

Silence is counted in this process's own running time. When two checks are further apart than one
heartbeat interval, this process (or the whole machine) was not running: stopped, its VM's time
stolen, swapping, or starved of the CPU. Messages that peers sent meanwhile wait unread in its
socket, so the gap counts as one interval and no more: a node that wakes up does not declare its
peers dead before it has read what they said. A process that stays starved still accumulates one
interval per check, so a peer that really died is still found.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class Liveness:
    def __init__(self, interval: float, window: float, name: str = "") -> None:
        self.interval = interval
        self.window = window
        self.name = name
        self.paused_s = 0.0  # total time between checks not counted as silence
        self._since: dict[str, float] = {}  # watched peer -> when it was first watched
        self._heard: dict[str, float] = {}  # watched peer -> when it last said anything
        self._last_check: float | None = None

    def __len__(self) -> int:
        return len(self._since)

    def watching(self, addr: str) -> bool:
        return addr in self._since

    def heard(self, addr: str, now: float) -> None:
        """A message from `addr`; only watched peers are recorded, so the record stays bounded."""
        if addr in self._since:
            self._heard[addr] = now

    def check(self, live: Iterable[str], now: float) -> list[tuple[str, float]]:
        """Watch exactly `live`; (peer, seconds silent) for each past the window. The dead stay
        watched until `forget()`."""
        self._discount_pause(now)
        live = set(live)
        for addr in [a for a in self._since if a not in live]:
            self.forget(addr)
        dead = []
        for addr in live:
            since = self._since.setdefault(addr, now)
            silent = now - max(self._heard.get(addr, since), since)
            if silent > self.window:
                dead.append((addr, silent))
        return dead

    def forget(self, addr: str) -> None:
        self._since.pop(addr, None)
        self._heard.pop(addr, None)

    def _discount_pause(self, now: float) -> None:
        last, self._last_check = self._last_check, now
        if last is None or now - last <= self.interval:
            return
        paused = now - last - self.interval
        self.paused_s += paused
        logger.info("%s: %.1fs between liveness checks (the process was not running): peers' silence over it "
                    "counts as %.1fs", self.name or "liveness", now - last, self.interval)
        for table in (self._since, self._heard):
            for addr, t in table.items():
                table[addr] = min(t + paused, now)
