"""The ZMQ control plane between prefill and decode ranks: messages and sockets.

Every KV manager binds one PULL socket (`tcp://ip:port`, random free port) for everything it
receives, and keeps one PUSH socket per peer it talks to. A peer is identified by the address of its
PULL socket, which every message carries in `src`. Messages are msgspec structs encoded as msgpack
with a type tag:

* decode -> prefill: `RegisterPeer` (once per prefill rank: the decode rank's engine description,
  buffer addresses, item sizes and strides, TP place, its node's compatibility fingerprint), then
  `TransferInfo` per room (destination pages, metadata slot, state slots, whether this prefill rank
  writes the metadata row), `Abort` when the decode side gives a room up.
* prefill -> decode: `Status` per room (`ok` = Success, or Failed with a reason); `AbortAck` once a
  room the decode side aborted has no chunk job left that could still write into its memory (the
  decode keeps the room's pages out of use until then).
* both ways: `Ping` / `Pong` heartbeats.

Authentication. With a cluster secret (`transfer/auth.py`) every frame is sealed: MAGIC "PDA1" |
timestamp 8 B | nonce 16 B | HMAC-SHA256 32 B | msgpack body, the MAC bound to the receiving
address. The receiver drops, before decoding the body, a frame that does not open (no or a bad
MAC: unauthenticated; outside the time window or a nonce seen before: stale or replayed), and
counts it. Without a secret frames are the bare msgpack body, as before.

Limits. A frame's body may be `MAX_MESSAGE_BYTES` (8 MiB): the largest legitimate message is a
`TransferInfo` for a request of 2**20 pages (a 1M-token context at page size 1, or 16M tokens at
16), ~5.2 MB of msgpack with 4-byte page indices; a `RegisterPeer` of 1,000 layers with a 64 KiB
engine description is ~120 KB. Larger frames are dropped and counted; beyond
`ZMQ_MAX_MESSAGE_BYTES` (16 MiB, the PULL socket's `MAXMSGSIZE`) zmq itself cuts the sender's
connection, so no frame can make the receiver allocate more. A frame whose `src` is not a
`tcp://host:port` address is dropped as undecodable. At most `max_peers` PUSH sockets are open
(`PDSERVE_CONTROL_MAX_PEERS`, 256: a decode rank's prefill ranks, or a prefill rank's decode
ranks, of a large cluster): the least recently used is closed first (flushing for at most
`EVICT_LINGER_MS`, 100 ms), and a dead peer's socket at once; with those still flushing, a context
holds at most 2 * max_peers + 16 sockets. `close()` closes the rest with a linger of
`CLOSE_LINGER_MS` (1 s) so that what is queued still goes out: it returns when it did, or after the
linger. `send()` never raises: a bad address or a full context returns False and is logged once
per peer (at most 20 lines per 10 s); a sender other than the receiver thread first waits up to
`FULL_WAIT_S` (1 s) for a context full of sockets still flushing to drain.

Heartbeats (used by `transfer/manager.py`): every `heartbeat_interval` a manager sends `Ping` to each
peer it has live rooms with; the peer answers `Pong` at once if it knows the sender. Any message
from such a peer counts as a sign of life. A peer silent for `heartbeat_interval * heartbeat_max_failures`
seconds while rooms
are live is declared dead and all rooms with it fail with a reason naming it. Sends never block: a
peer whose queue is full (it is gone) simply misses messages and is then caught by the heartbeat.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Union

import msgspec
import zmq

from transfer.auth import CONTROL, HEADER_BYTES, Authenticator, AuthError, DropCounters

if TYPE_CHECKING:
    from transfer.base import KVArgs

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20  # the largest frame body accepted (see the module docstring)
ZMQ_MAX_MESSAGE_BYTES = 16 << 20  # zmq drops the connection of a peer sending more than this
DEFAULT_MAX_PEERS = 256
CLOSE_LINGER_MS = 1000
FULL_WAIT_S = 1.0  # how long a sender other than the receiver thread waits for a full context
EVICT_LINGER_MS = 100  # an evicted peer is the least recently used: little or nothing left to flush
_FAILURE_LOGS = 20  # send-failure lines per 10 s at most
_ADDRESS = re.compile(r"tcp://(?:[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


def valid_address(addr: str) -> bool:
    """Whether `addr` is a `tcp://host:port` address a peer can have (host name or IP, port 1-65535)."""
    m = _ADDRESS.fullmatch(addr)
    return m is not None and 0 < int(m.group(1)) < 65536


class RegisterPeer(msgspec.Struct, tag="register"):
    src: str
    engine_desc: bytes
    tp_rank: int
    tp_size: int
    kv_head_num: int
    total_kv_heads: int
    kv_ptrs: list[int]
    kv_item_lens: list[int]
    kv_item_strides: list[int]  # bytes from a page of a kv buffer to the next page of that buffer
    aux_ptrs: list[int]
    aux_item_lens: list[int]
    state_ptrs: list[int]
    state_item_lens: list[int]
    state_dims: list[int]
    page_size: int
    model: str
    kv_layer_ids: list[int]  # the model layer of kv buffers i and layers + i
    state_layer_ids: list[int]  # the model layer of each state buffer
    kv_num_pages: int = 0  # pages per kv buffer (page 0 is padding); 0: not sent (rejected)
    aux_num_rows: int = 0  # metadata rows per aux buffer
    state_num_slots: int = 0  # items per state buffer
    kv_memory: str = "host"  # where the kv buffers live: "host" or "cuda:N" (transfer/memory.py)
    state_memory: str = "host"  # where the state buffers live (aux rows are host memory)
    # the decode node's pairing key (common/fingerprint.py); "" from a node that sends none
    fingerprint: Annotated[str, msgspec.Meta(max_length=128)] = ""


Traceparent = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")]


class TransferInfo(msgspec.Struct, tag="info"):
    src: str
    room: int
    tp_rank: int
    tp_size: int
    dst_page_indices: list[int]
    metadata_index: int
    state_indices: list[int]
    expects_metadata: bool  # this prefill rank is the one that writes the metadata row
    # the decode request's W3C trace context (--enable-trace): the prefill's transfer span links to it
    traceparent: Traceparent | None = None


class Status(msgspec.Struct, tag="status"):
    src: str
    room: int
    ok: bool
    reason: str
    tp_rank: int
    pp_rank: int
    unregistered: bool = False  # the prefill rank does not know the sender: register again


class Abort(msgspec.Struct, tag="abort"):
    src: str
    room: int
    reason: str


class AbortAck(msgspec.Struct, tag="abort_ack"):
    """No chunk job of `room` on this prefill rank can write into the decode's memory any more."""

    src: str
    room: int
    tp_rank: int
    pp_rank: int


class Ping(msgspec.Struct, tag="ping"):
    src: str


class Pong(msgspec.Struct, tag="pong"):
    src: str


def peer_registration(a: KVArgs, src: str, engine_desc: bytes) -> RegisterPeer:
    """The `RegisterPeer` a decode rank with buffers `a` sends to a prefill rank."""
    return RegisterPeer(
        src=src, engine_desc=engine_desc, tp_rank=a.engine_rank, tp_size=a.tp_size, kv_head_num=a.kv_head_num,
        total_kv_heads=a.total_kv_heads, kv_ptrs=a.kv_data_ptrs,
        kv_item_lens=a.kv_item_lens, kv_item_strides=a.kv_item_strides, aux_ptrs=a.aux_data_ptrs,
        aux_item_lens=a.aux_item_lens, state_ptrs=a.state_data_ptrs, state_item_lens=a.state_item_lens,
        state_dims=a.state_dim_per_tensor, page_size=a.page_size, model=a.model, kv_layer_ids=a.kv_layer_ids,
        state_layer_ids=a.state_layer_ids,
        kv_num_pages=(a.kv_data_lens[0] - a.kv_item_lens[0]) // a.kv_item_strides[0] + 1,
        aux_num_rows=_items(a.aux_data_lens, a.aux_item_lens),
        state_num_slots=_items(a.state_data_lens, a.state_item_lens), kv_memory=a.kv_memory,
        state_memory=a.state_memory, fingerprint=a.fingerprint)


def _items(lens: list[int], item_lens: list[int]) -> int:
    """Items every one of the buffers holds (0 without buffers)."""
    return min((n // max(m, 1) for n, m in zip(lens, item_lens, strict=True)), default=0)


Message = Union[RegisterPeer, TransferInfo, Status, Abort, AbortAck, Ping, Pong]  # noqa: UP007 - msgspec wants Union


class ControlPlane:
    """One PULL socket with a receiver thread, and non-blocking PUSH sockets to peers (at most
    `max_peers`, least recently used closed first). With `auth` every frame is sealed on the way out
    and must open on the way in; `counters` counts what the receiver dropped, and why."""

    def __init__(self, host: str, on_message: Callable[[Message], None], name: str = "control",
                 auth: Authenticator | None = None, max_peers: int = DEFAULT_MAX_PEERS,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        if max_peers < 1:
            raise ValueError("a control plane needs max_peers >= 1")
        self._ctx = zmq.Context()
        # open peers, as many closed ones still flushing (for at most CLOSE_LINGER_MS), the PULL socket
        self._ctx.set(zmq.MAX_SOCKETS, 2 * max_peers + 16)
        self._auth = auth
        self.max_peers = max_peers
        self.max_message_bytes = max_message_bytes
        self._frame_limit = max_message_bytes + (HEADER_BYTES if auth else 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MESSAGE_BYTES)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.port = port
        self.address = f"tcp://{host}:{port}"
        self._context = CONTROL + self.address.encode() + b"\0"  # MACs are bound to this receiver
        self._on_message = on_message
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        self.counters = DropCounters(f"control plane {self.address}", logger)
        self.send_failures = 0
        self.peers_evicted = 0
        self._push: OrderedDict[str, tuple[zmq.Socket, threading.Lock]] = OrderedDict()
        self._push_lock = threading.Lock()
        self._failed_peers: OrderedDict[str, None] = OrderedDict()  # peers whose send failure was logged
        self._failure_log_window, self._failure_logs = 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-recv", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ receiving
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            try:
                msg = self._accept(raw)
                if msg is not None:
                    self._on_message(msg)
            except Exception:  # the receiver thread outlives any one message
                logger.exception("control plane: handler failed")

    def _accept(self, raw: bytes) -> Message | None:
        """The message in a frame, or None if the frame is dropped (oversized, unauthenticated, stale,
        replayed, undecodable); the body of a frame that fails authentication is never decoded."""
        if len(raw) > self._frame_limit:
            self.counters.drop("oversized", f"{len(raw)} bytes, limit {self._frame_limit}")
            return None
        body = raw
        if self._auth is not None:
            try:
                body = self._auth.open(self._context, raw)
            except AuthError as e:
                self.counters.drop_auth(e)
                return None
        try:
            msg = self._decoder.decode(body)
        except msgspec.DecodeError as e:
            self.counters.drop("undecodable", str(e))
            return None
        if not valid_address(msg.src):
            self.counters.drop("undecodable", f"src is not a tcp://host:port address: {msg.src[:80]!r}")
            return None
        return msg

    # ------------------------------------------------------------------ sending
    def send(self, addr: str, msg: Message) -> bool:
        """Queue a message to a peer; False if it could not be queued (peer gone, bad address, no
        socket left, closing). Never raises."""
        if self._stop.is_set():
            return False
        try:
            body = self._encoder.encode(msg)
            frame = body if self._auth is None else self._auth.seal(CONTROL + addr.encode() + b"\0", body)
        except Exception as e:
            self._send_failed(addr, f"cannot encode {type(msg).__name__}: {e}")
            return False
        for _ in range(2):  # a second try if the socket was evicted between lookup and send
            entry = self._socket(addr)
            if entry is None:
                return False
            sock, lock = entry
            with lock:
                if sock.closed:
                    continue
                try:
                    sock.send(frame, zmq.NOBLOCK)
                    return True
                except Exception as e:  # queue full: the peer is gone; the heartbeat will tell
                    logger.debug("control plane: could not send %s to %s (%s)", type(msg).__name__, addr, e)
                    return False
        return False

    def _socket(self, addr: str) -> tuple[zmq.Socket, threading.Lock] | None:
        """The PUSH socket to `addr`, opened on first use; the least recently used ones are closed
        (with a linger of `EVICT_LINGER_MS`, to flush) to stay within `max_peers`. When the context
        is full of sockets still flushing, a caller other than the receiver thread (which must keep
        reading) waits up to `FULL_WAIT_S` for zmq to reap them: a room's Status is worth the wait."""
        deadline = time.monotonic() + FULL_WAIT_S
        while True:
            entry, failure, full = self._open(addr)
            if not full or threading.current_thread() is self._thread or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if failure:
            self._send_failed(addr, failure)
        return entry

    def _open(self, addr: str) -> tuple[tuple[zmq.Socket, threading.Lock] | None, str, bool]:
        """(entry, why it failed, whether the context is full) for one attempt of `_socket`."""
        evicted: list[tuple[str, tuple[zmq.Socket, threading.Lock]]] = []
        entry, failure, full = None, "", False
        with self._push_lock:
            if self._stop.is_set():
                return None, "", False
            entry = self._push.get(addr)
            if entry is not None:
                self._push.move_to_end(addr)
                return entry, "", False
            if not valid_address(addr):
                failure = "not a tcp://host:port address"
            else:
                while len(self._push) >= self.max_peers:
                    evicted.append(self._push.popitem(last=False))
                try:
                    sock = self._ctx.socket(zmq.PUSH)
                    try:
                        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
                        sock.setsockopt(zmq.SNDHWM, 10000)
                        sock.connect(addr)
                    except Exception:
                        sock.close(0)
                        raise
                    entry = self._push[addr] = (sock, threading.Lock())
                except Exception as e:  # a full context (too many sockets), an address zmq refuses
                    failure = str(e) or type(e).__name__
                    full = isinstance(e, zmq.ZMQError) and e.errno == errno.EMFILE
        for old, (sock, lock) in evicted:
            with lock:
                sock.close(EVICT_LINGER_MS)
            self.peers_evicted += 1
            logger.info("control plane: closed the socket to %s, the least recently used of "
                        "%d peers", old[:80], self.max_peers)
        return entry, failure, full

    def _send_failed(self, addr: str, why: str) -> None:
        """Count a failed send; log it once per peer (a bounded memory of peers already logged), and
        at most `_FAILURE_LOGS` lines per 10 s when many peers fail at once (a flood of bogus peers)."""
        now = time.monotonic()
        with self._push_lock:
            self.send_failures += 1
            first = addr not in self._failed_peers
            self._failed_peers[addr] = None
            self._failed_peers.move_to_end(addr)
            if len(self._failed_peers) > 4 * self.max_peers:
                self._failed_peers.popitem(last=False)
            if now - self._failure_log_window >= 10.0:
                self._failure_log_window, self._failure_logs = now, 0
            log = first and self._failure_logs < _FAILURE_LOGS
            self._failure_logs += first
        if log:
            logger.warning("control plane: cannot send to %s: %s (%d sends failed so far)", addr[:80], why,
                           self.send_failures)

    def has_peer(self, addr: str) -> bool:
        """Whether a socket to `addr` is open (this side has talked to it)."""
        with self._push_lock:
            return addr in self._push

    @property
    def peers_open(self) -> int:
        return len(self._push)

    def stats(self) -> dict[str, int]:
        return {**self.counters.as_stats("control_"), "control_send_failures": self.send_failures,
                "control_peers_open": self.peers_open, "control_peers_evicted": self.peers_evicted}

    def drop(self, addr: str) -> None:
        """Close the socket to a dead peer at once (a new one is made if it comes back)."""
        with self._push_lock:
            entry = self._push.pop(addr, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(0)

    def close(self) -> None:
        """Stop receiving; close the peers' sockets with a short linger so that messages already
        queued (a room's last Status may be the first message on its socket, not yet connected) are
        flushed, for at most `CLOSE_LINGER_MS`."""
        self._stop.set()
        self._thread.join(timeout=2)
        with self._push_lock:
            entries = list(self._push.values())
            self._push.clear()
        for sock, lock in entries:
            with lock:
                sock.close(CLOSE_LINGER_MS)
        self._pull.close(0)
        self._ctx.term()  # returns once every queued message went out or its linger ran out
