"""The schedulers' report socket (`common/frames.py`) over real Unix sockets: frames arrive whole and in
order from several senders, however the bytes are split; a sender waits for a listener that is not
there yet; an oversized frame ends only its own connection; a scheduler whose front end is gone stops
instead of crashing."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import time

import pytest

from common.frames import HEADER, MAX_FRAME, FrameListener, FrameSender, read_frame
from common.protocol import BatchOut, ReqUpdate
from common.scheduler.process import IpcConfig, SchedulerComm


def _recv_all(listener: FrameListener, n: int, timeout: float = 20.0) -> list[bytes]:
    async def go():
        return [await asyncio.wait_for(listener.recv(), timeout) for _ in range(n)]

    return asyncio.run(go())


def test_frames_from_several_senders_arrive_whole_and_in_order():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "reports")
        sizes = [0, 1, 5, 3 * 2**20, 7]  # a large one spans many reads of the socket
        senders = []

        def send(tag: bytes):
            s = FrameSender(path, timeout=20)  # the listener does not exist yet: it retries
            senders.append(s)
            for n in sizes:
                s.send(tag + bytes([len(tag)]) * n)

        threads = [threading.Thread(target=send, args=(tag,)) for tag in (b"a", b"b")]
        for t in threads:
            t.start()
        time.sleep(0.2)
        listener = FrameListener(path)
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        got = _recv_all(listener, 2 * len(sizes))
        for t in threads:
            t.join()
        for tag in (b"a", b"b"):
            mine = [f for f in got if f[:1] == tag]
            assert [len(f) - 1 for f in mine] == sizes  # each sender's frames whole, in its order
        for s in senders:
            s.close()
        listener.close()
        assert not os.path.exists(path)


def test_an_oversized_frame_ends_only_its_connection():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "reports")
        listener = FrameListener(path)
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(path)
        bad.sendall(HEADER.pack(MAX_FRAME + 1) + b"x" * 100)
        good = FrameSender(path, timeout=5)
        good.send(b"still here")

        async def go():
            first = await asyncio.wait_for(listener.recv(), 20)
            await asyncio.sleep(0.2)  # the bad connection's bytes have been read by now
            assert bad.recv(1) == b""  # the listener closed the bad connection ...
            good.send(b"after it")  # ... and still reads the good one
            return first, await asyncio.wait_for(listener.recv(), 20)

        bad.settimeout(5)
        assert asyncio.run(go()) == (b"still here", b"after it")
        bad.close()
        good.close()
        listener.close()


def test_a_sender_without_a_listener_gives_up_after_its_timeout():
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="no front end listening"):
            FrameSender(os.path.join(tmp, "nobody"), timeout=0.3)
        assert time.monotonic() - t0 < 5


def test_read_frame_reads_one_frame_from_a_blocking_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendall(HEADER.pack(3) + b"abc" + HEADER.pack(0))
    assert read_frame(b) == b"abc"
    assert read_frame(b) == b""
    a.close()
    with pytest.raises(ConnectionError):
        read_frame(b)
    b.close()


def test_scheduler_stops_when_its_front_end_closed_the_report_socket():
    with tempfile.TemporaryDirectory() as tmp:
        ipc = IpcConfig(to_scheduler=f"ipc://{tmp}/to", from_scheduler=os.path.join(tmp, "from"),
                        dist_init_method="", front_end_pid=os.getpid())
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(ipc.from_scheduler)
        listener.listen(1)
        comm = SchedulerComm(ipc, 0, 1)
        conn, _ = listener.accept()
        msg = BatchOut(updates=[ReqUpdate(rid="r", new_token_ids=[1, 2], prompt_tokens=3,
                                          completion_tokens=2)])
        comm.send(msg)
        conn.settimeout(5)
        assert read_frame(conn) == comm.encoder.encode(msg)
        conn.close()
        listener.close()
        for _ in range(50):  # the first writes after the close may still be buffered
            comm.send(msg)
            if comm.stop_requested:
                break
        assert comm.stop_requested and comm.front_end_closed
        assert comm.recv(0) is None  # the loop stops at its next receive
        comm.close()
