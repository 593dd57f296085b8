"""Quarantine: the memory of failed rooms a prefill rank may still be writing into.

When a request ends on a decode node while its transfer is not done (aborted, timed out, failed), a
prefill rank may be inside its engine's `write` to the request's pages at that moment; pages handed
to another request then would be overwritten by the late write. So the request's pages, its row
(which owns its hybrid state slot) and its metadata slot go here instead of back to their pools,
and stay until the room's receiver drains (`KVReceiver.drain_poll`: every prefill rank that had
the room's TransferInfo acknowledged the abort, or was declared dead). The role polls the drains
with the same TP consensus as transfers, so every rank frees the same memory in the same iteration.
A room whose TransferInfo never went out, or that reached Success, drains at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from transfer.base import KVPoll


@dataclass
class QuarantinedRoom:
    rid: str
    room: int
    conn: object  # the room's KVReceiver
    pages: list[int]
    row: int | None
    metadata_index: int | None
    since: float = field(default_factory=time.monotonic)

    def poll(self) -> KVPoll:
        return self.conn.drain_poll()


class Quarantine:
    def __init__(self) -> None:
        self._rooms: list[QuarantinedRoom] = []

    def add(self, q: QuarantinedRoom) -> None:
        self._rooms.append(q)

    def release(self, polls: list[KVPoll]) -> list[QuarantinedRoom]:
        """Given the consensus polls of `list(self)`, take the drained rooms out and return them."""
        done = [q for q, p in zip(self._rooms, polls, strict=True) if p == KVPoll.Success]
        self._rooms = [q for q, p in zip(self._rooms, polls, strict=True) if p != KVPoll.Success]
        return done

    def holds_room(self, room: int) -> bool:
        return any(q.room == room for q in self._rooms)

    def num_pages(self) -> int:
        return sum(len(q.pages) for q in self._rooms)

    def __iter__(self) -> Iterator[QuarantinedRoom]:
        return iter(list(self._rooms))

    def __len__(self) -> int:
        return len(self._rooms)
