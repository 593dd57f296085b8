"""A request's state on a PD node, and the queues of a role's stages.

`PDRequest` is what a role keeps of one request from its arrival until the role lets it go: its
stage, its room (`bootstrap_room`), its sender or receiver (`conn`) and the metadata slot it holds.
Each role subclasses it with the fields of its own stages (prefill_node/queues.py,
decode_node/queues.py).

A stage's requests wait in a `StageQueue`, oldest first. Adding a request to a queue sets its stage,
so a request's stage always says which queue holds it.

The limits below are those of the wire: a room travels in an int64 metadata field, and the metadata
row carries a fixed number of top logprobs for the first token (a request asking for more is
refused on arrival).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from common.scheduler.req import Req

MAX_TOP_LOGPROBS = 20  # first-token top logprobs carried from prefill to decode
MAX_ROOM = (1 << 63) - 1  # rooms travel in an int64 metadata field

# the stages (prefill, decode) in which no KV has moved yet: a failure there is a bootstrap failure,
# counted apart from failures of the transfer itself
BEFORE_TRANSFER = frozenset({"bootstrap", "prealloc"})


@dataclass(kw_only=True)
class PDRequest:
    """A request's PD state on one rank: its stage, its room, its sender or receiver (`conn`), and the
    metadata slot it holds."""

    req: Req
    room: int
    conn: Any
    stage: enum.Enum
    metadata_index: int | None = None
    created: float = field(default_factory=time.monotonic)
    failed: bool = False  # counted as a transfer failure

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def before_transfer(self) -> bool:
        """No KV of the request has moved yet (its stage is one of `BEFORE_TRANSFER`)."""
        return self.stage.value in BEFORE_TRANSFER


class StageQueue:
    """The requests of one stage, oldest first. `add` sets the request's stage; a role's subclasses
    move their requests on."""

    stage: enum.Enum

    def __init__(self) -> None:
        self._reqs: dict[str, PDRequest] = {}

    def add(self, t: PDRequest) -> None:
        t.stage = self.stage
        t.req.mark(self.stage.value)
        self._reqs[t.rid] = t

    def discard(self, t: PDRequest) -> None:
        self._reqs.pop(t.rid, None)

    def move(self, t: PDRequest, to: StageQueue) -> None:
        """The request moves on to the next stage's queue."""
        self.discard(t)
        to.add(t)

    def __iter__(self) -> Iterator[PDRequest]:
        return iter(list(self._reqs.values()))

    def __len__(self) -> int:
        return len(self._reqs)
