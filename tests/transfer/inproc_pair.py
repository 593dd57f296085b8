"""One prefill and one decode KV manager in this process, over a real bootstrap server, real ZMQ
sockets and a real engine, for tests that need to reach inside a transfer (block a write, send a
hostile message, look at a manager's state) at a precise moment.

The buffers are `kv_harness`'s: the prefill pool, state buffer and metadata rows hold seeded bytes,
the decode ones start at zero. `Pair.transfer(room, src_pages, dst_pages, ...)` runs one room to its
end; `Pair.pages_hold(dst_pages, src_pages)` / `state_holds` / `row_room` say whether the decode
side holds exactly the source's bytes. `GatedEngine` wraps an engine so that the next write after
`arm()` waits before it reaches the engine until `release()` (or fails on `fail()`): a write in
progress, for as long as a test needs. `memory={"kv_memory": "cuda:0", ...}` declares both sides' buffers in
that
memory kind (for the fake engine's kind checks). `Garbage(answers)` is an HTTP server (a hostile bootstrap
server) answering every GET with whatever `answers(path)` gives.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Sequence

import torch

from tests.transfer import kv_harness as h
from transfer.backends import create_engine
from transfer.base import KVPoll
from transfer.bootstrap import BootstrapServer
from transfer.engine import BackendUnavailable, TransferEngine, TransferError
from transfer.receiver import KVReceiver
from transfer.sender import KVSender

SETTINGS = {**h.FAST, "abort_ack_timeout": 60.0}
FIRST_TOKEN = 4242


def wait(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def engine_or_skip(backend: str) -> TransferEngine:
    import pytest

    try:
        return create_engine(backend, "127.0.0.1")
    except BackendUnavailable as e:
        pytest.skip(str(e))


class GatedEngine(TransferEngine):
    """A real engine whose next write after `arm()` blocks before reaching it until `release()`
    (then it writes) or `fail()` (then it raises without touching the engine)."""

    def __init__(self, inner: TransferEngine) -> None:
        super().__init__(inner.hostname, inner.device_name)
        self.inner = inner
        self.name = f"gated-{inner.name}"
        self.moves_bytes = getattr(inner, "moves_bytes", True)
        self._lock = threading.Lock()
        self._armed = False
        self.entered = threading.Event()
        self._open = threading.Event()
        self._fail = False
        self.done = threading.Event()

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def release(self) -> None:
        self._open.set()

    def fail(self) -> None:
        self._fail = True
        self._open.set()

    def register(self, ptr: int, length: int, memory: str = "host") -> None:
        self.inner.register(ptr, length, memory)

    def describe(self) -> bytes:
        return self.inner.describe()

    def add_peer(self, description: bytes) -> str:
        return self.inner.add_peer(description)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = "host", dst_memory: str = "host") -> None:
        with self._lock:
            gated, self._armed = self._armed, False
        if not gated:
            self.inner.write(peer, src, dst, lengths, src_memory, dst_memory)
            return
        self.entered.set()
        self._open.wait(120)
        try:
            if self._fail:
                raise TransferError("gated write dropped by the test")
            self.inner.write(peer, src, dst, lengths, src_memory, dst_memory)
        finally:
            self.done.set()

    def close(self) -> None:
        self._open.set()
        self.inner.close()


class Pair:
    """A prefill manager (engine `prefill_engine`) and a decode manager (engine `decode_engine`)."""

    def __init__(self, prefill_engine: TransferEngine, decode_engine: TransferEngine, seed: int = 5,
                 memory: dict | None = None, **settings) -> None:
        self.seed = seed
        self.server = BootstrapServer("127.0.0.1", 0)
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.port}"
        s = {**SETTINGS, **settings}
        self.prefill, self.ppool, self.pmeta, self.pstate = h._build(
            "prefill", 0, 1, {"seed": seed, "backend": prefill_engine, **(memory or {})}, self.addr, s)
        self.decode, self.dpool, self.dmeta, self.dstate = h._build(
            "decode", 0, 1, {"backend": decode_engine, **(memory or {})}, None, s)
        self.src_kv = h.global_kv(seed)
        self.src_state = h.global_state(seed)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.server.stop()

    # ------------------------------------------------------------------ one room
    def start(self, room: int, src_pages: list[int], dst_pages: list[int],
              src_meta: int = 0, dst_meta: int = 0,
              src_state: int = 0, dst_state: int = 0) -> tuple[KVSender, KVReceiver]:
        """Both sides of a room, inited; the prefill's metadata row holds the room and FIRST_TOKEN."""
        self.pmeta.set_buf(src_meta, FIRST_TOKEN, cached_tokens=1, logprob_val=-0.5, logprob_idx=FIRST_TOKEN,
                           top_vals=[-0.5, -1.5], top_idxs=[FIRST_TOKEN, 17], room=room)
        recv = KVReceiver(self.decode, self.addr, room)
        recv.init(dst_pages, dst_meta, [dst_state])
        send = KVSender(self.prefill, room)
        send.init(len(src_pages), src_meta)
        return send, recv

    def transfer(self, room: int, src_pages: list[int], dst_pages: list[int], src_state: int = 0,
                 dst_state: int = 0, **kw) -> tuple[KVSender, KVReceiver]:
        """Run one room to its end (both sides Success or Failed)."""
        send, recv = self.start(room, src_pages, dst_pages, src_state=src_state, dst_state=dst_state, **kw)
        send.send(src_pages, [src_state], last=True)
        wait(lambda: send.poll() in (KVPoll.Success, KVPoll.Failed) and recv.poll() in (KVPoll.Success,
                                                                                          KVPoll.Failed))
        return send, recv

    # ------------------------------------------------------------------ what the decode side holds
    def pages_hold(self, dst_pages: list[int], src_pages: list[int]) -> bool:
        for layer in range(h.SHAPE["layers"]):
            for kv, buf in ((0, self.dpool.k(layer)), (1, self.dpool.v(layer))):
                for sp, dp in zip(src_pages, dst_pages, strict=True):
                    if not torch.equal(buf[dp], self.src_kv[kv, layer, sp]):
                        return False
        return True

    def state_holds(self, dst_slot: int, src_slot: int) -> bool:
        return torch.equal(self.dstate[dst_slot], self.src_state[src_slot])

    def row_room(self, dst_meta: int) -> int:
        return self.dmeta.get_room(dst_meta)

    def threads_alive(self) -> bool:
        """The managers' timers, control receivers, the resolver and the bootstrap server still run."""
        return all(t.is_alive() for t in (self.prefill._timer, self.decode._timer, self.decode._resolver,
                                          self.prefill.control._thread, self.decode.control._thread))

    def idle(self) -> bool:
        """No room live or draining on either side."""
        p, d = self.prefill, self.decode
        with p._lock, d._lock:
            return not (p._senders or p._draining or d._receivers or d._draining)


class Garbage:
    """An HTTP server answering every GET with the body its `answers(path)` gives."""

    def __init__(self, answers) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                ctype, body = answers(self.path)
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
