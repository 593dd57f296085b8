"""Aborts that arrive before their request.

A router abandons a leg whose request may still be on its way to this node (in the socket, or being
tokenized). `abort(rid)` for a rid the front end does not know yet is remembered here, for a while
and up to a bound (whatever clients send), so that when the request arrives it is ended at once
instead of waiting out its bootstrap timeout with its room and memory.
"""

from __future__ import annotations

import collections
import time

EARLY_ABORTS_MAX = 10_000  # aborts of unknown rids remembered at most
EARLY_ABORT_TTL = 30.0  # seconds such an abort waits for its request


class EarlyAborts:
    def __init__(self) -> None:
        self._by_rid: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()

    def record(self, rid: str, message: str) -> None:
        """Remember an abort of `rid` (the newest is forgotten last)."""
        self._by_rid[rid] = (time.monotonic(), message)
        self._by_rid.move_to_end(rid)
        while len(self._by_rid) > EARLY_ABORTS_MAX:
            self._by_rid.popitem(last=False)

    def take(self, rids: list[str]) -> str | None:
        """The message of an abort that came for one of `rids` within EARLY_ABORT_TTL before them; the
        aborts of all of `rids` are forgotten."""
        now = time.monotonic()
        while self._by_rid:
            rid, (when, _) = next(iter(self._by_rid.items()))
            if now - when <= EARLY_ABORT_TTL:
                break
            del self._by_rid[rid]
        found = None
        for rid in rids:
            hit = self._by_rid.pop(rid, None)
            if hit is not None:
                found = hit[1]
        return found
