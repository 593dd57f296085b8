"""Length-prefixed frames over a Unix stream socket: the way a node's schedulers report to its front end.

Each frame is a 4-byte little-endian length and that many bytes (one msgpack message). The scheduler's
rank 0 writes a frame with one `sendall` from its own thread, and the front end's event loop reads the
socket itself: a streamed token costs the front end one wakeup. (A ZMQ PUSH/PULL pair moves each message
through an I/O thread on either side, two more wakeups per token, on a host whose cores the forward's
threads are using.)

* `FrameListener(path)`: the front end's socket, bound and listening at once (a scheduler that connects
  before the event loop runs waits in the backlog); `await recv()` gives the next frame of any connected
  scheduler, in each one's order.
* `FrameSender(path, timeout)`: a scheduler's connection; it retries until the front end listens.
  `send` blocks while the socket's buffer is full (the front end not reading), as the scheduler's output
  must not be dropped.
* `read_frame(sock)`: one frame from a blocking socket (a test's front end).

A frame longer than `MAX_FRAME` ends its connection, as a peer that sends one is not a scheduler of ours.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

logger = logging.getLogger("frames")

HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a message that large is not one of ours


class FrameSender:
    def __init__(self, path: str, timeout: float) -> None:
        """Connect to the front end at `path`, retrying for up to `timeout` seconds (it may be starting)."""
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no front end listening at {path} after {timeout:.0f}s") from None
                time.sleep(0.02)
        self.sock = sock

    def send(self, data: bytes) -> None:
        if len(data) > MAX_FRAME:
            raise ValueError(f"a frame of {len(data)} bytes is more than {MAX_FRAME}")
        self.sock.sendall(HEADER.pack(len(data)) + data)

    def close(self) -> None:
        self.sock.close()


def read_frame(sock: socket.socket) -> bytes:
    """One frame from a blocking socket (ConnectionError at its end)."""
    (n,) = HEADER.unpack(_read_exactly(sock, HEADER.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes announced")
    return _read_exactly(sock, n)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


class _FrameProtocol(asyncio.Protocol):
    """One scheduler's connection: complete frames go into the listener's queue, in order."""

    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue
        self.buf = bytearray()
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        start = 0
        while len(buf) - start >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, start)
            if n > MAX_FRAME:
                logger.error("a scheduler connection announced a frame of %d bytes; closing it", n)
                self.transport.close()
                buf.clear()
                return
            if len(buf) - start - HEADER.size < n:
                break
            self.queue.put_nowait(bytes(buf[start + HEADER.size:start + HEADER.size + n]))
            start += HEADER.size + n
        if start:
            del buf[:start]

    def connection_lost(self, exc) -> None:
        if self.buf:
            logger.warning("a scheduler connection ended inside a frame (%d bytes kept back)", len(self.buf))
        self.buf = bytearray()


class FrameListener:
    def __init__(self, path: str) -> None:
        """Bind and listen at `path` now; frames are read once `recv` is first awaited."""
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)  # this user's processes only, as the run directory
        self.sock.listen(64)
        self.queue: asyncio.Queue | None = None
        self.server = None

    async def recv(self) -> bytes:
        if self.server is None:
            self.queue = asyncio.Queue()
            self.server = await asyncio.get_running_loop().create_unix_server(
                lambda: _FrameProtocol(self.queue), sock=self.sock)
        return await self.queue.get()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        else:
            self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
