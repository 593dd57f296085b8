"""The front end's sockets to its node's scheduler processes.

One PUSH socket per DP group, bound to the address that group's rank 0 connects to, carries requests,
aborts and queries (`ToScheduler`, msgpack). Sends never wait: the socket's queue is unbounded and a
send is NOBLOCK, so a send fails only when no scheduler is connected at all (`ServiceUnavailable`).
One Unix socket, which every group's rank 0 connects to, brings back what they report
(`FromScheduler`: `BatchOut`, `StatsReport`), one length-prefixed frame per message read by the event
loop itself (`common/frames.py`). The front end binds all of them; the ranks start before it: ZMQ
connects them on its next retry, which `wait_connected` waits for, and each rank 0 retries its connect
until the report socket listens.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from common.frames import FrameListener
from common.protocol import FromScheduler, ToScheduler


class ServiceUnavailable(RuntimeError):
    """The scheduler is gone or does not answer: HTTP 503."""


class SchedulerLink:
    def __init__(self, to_scheduler: list[str], from_scheduler: str) -> None:
        """`to_scheduler`: the address of each DP group's rank 0."""
        self._ctx = zmq.Context()
        self._pushes = []
        for addr in to_scheduler:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.bind(addr)
            self._pushes.append(push)
        self._reports = FrameListener(from_scheduler)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromScheduler)

    @property
    def size(self) -> int:
        """The number of DP groups."""
        return len(self._pushes)

    def wait_connected(self, timeout: float) -> bool:
        """True once every DP group's first rank has connected to its `to_scheduler` socket (a send before
        that finds no peer)."""
        deadline = time.monotonic() + timeout
        for push in self._pushes:
            if not push.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
                return False
        return True

    def send(self, msg: ToScheduler, dp_rank: int = 0) -> None:
        try:
            self._pushes[dp_rank].send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ServiceUnavailable("the scheduler is not connected") from None

    async def recv(self) -> bytes:
        """The next message's bytes, from any group (raises OSError when the socket failed)."""
        return await self._reports.recv()

    def decode(self, data: bytes) -> FromScheduler:
        """One received message (raises `msgspec.DecodeError` for bytes that are not one)."""
        return self._decoder.decode(data)

    def close(self) -> None:
        if self._ctx.closed:
            return
        self._reports.close()
        for push in self._pushes:
            push.close(0)
        self._ctx.term()
