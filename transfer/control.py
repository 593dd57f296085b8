"""The ZMQ control plane between prefill and decode ranks: messages and sockets.

Every KV manager binds one PULL socket (`tcp://ip:port`, random free port) for everything it
receives, and keeps one PUSH socket per peer it talks to. A peer is identified by the address of its
PULL socket, which every message carries in `src`. Messages are msgspec structs encoded as msgpack
with a type tag:

* decode -> prefill: `RegisterPeer` (once per prefill rank: the decode rank's engine description,
  buffer addresses, item sizes and strides, TP place), then `TransferInfo` per room (destination
  pages, metadata slot, state slots, whether this prefill rank writes the metadata row), `Abort`
  when the decode side gives a room up.
* prefill -> decode: `Status` per room (`ok` = Success, or Failed with a reason); `AbortAck` once a
  room the decode side aborted has no chunk job left that could still write into its memory (the
  decode keeps the room's pages out of use until then).
* both ways: `Ping` / `Pong` heartbeats.

Heartbeats (used by `transfer/manager.py`): every `heartbeat_interval` a manager sends `Ping` to each
peer it has live rooms with; the peer answers `Pong` at once. Any message from a peer counts as a
sign of life. A peer silent for `heartbeat_interval * heartbeat_max_failures` seconds while rooms
are live is declared dead and all rooms with it fail with a reason naming it. Sends never block: a
peer whose queue is full (it is gone) simply misses messages and is then caught by the heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import msgspec
import zmq

if TYPE_CHECKING:
    from transfer.base import KVArgs

logger = logging.getLogger(__name__)


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
    kv_num_pages: int = 0  # pages per kv buffer (page 0 is padding); 0: not sent (rejected)
    aux_num_rows: int = 0  # metadata rows per aux buffer
    state_num_slots: int = 0  # items per state buffer


class TransferInfo(msgspec.Struct, tag="info"):
    src: str
    room: int
    tp_rank: int
    tp_size: int
    dst_page_indices: list[int]
    metadata_index: int
    state_indices: list[int]
    expects_metadata: bool  # this prefill rank is the one that writes the metadata row


class Status(msgspec.Struct, tag="status"):
    src: str
    room: int
    ok: bool
    reason: str
    tp_rank: int
    pp_rank: int


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
        state_dims=a.state_dim_per_tensor, page_size=a.page_size, model=a.model,
        kv_num_pages=(a.kv_data_lens[0] - a.kv_item_lens[0]) // a.kv_item_strides[0] + 1,
        aux_num_rows=_items(a.aux_data_lens, a.aux_item_lens),
        state_num_slots=_items(a.state_data_lens, a.state_item_lens))


def _items(lens: list[int], item_lens: list[int]) -> int:
    """Items every one of the buffers holds (0 without buffers)."""
    return min((n // max(m, 1) for n, m in zip(lens, item_lens, strict=True)), default=0)


Message = Union[RegisterPeer, TransferInfo, Status, Abort, AbortAck, Ping, Pong]  # noqa: UP007 - msgspec wants Union


class ControlPlane:
    """One PULL socket with a receiver thread, and non-blocking PUSH sockets to peers."""

    def __init__(self, host: str, on_message: Callable[[Message], None], name: str = "control") -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.port = port
        self.address = f"tcp://{host}:{port}"
        self._on_message = on_message
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        self._push: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-recv", daemon=True)
        self._thread.start()

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
                msg = self._decoder.decode(raw)
            except msgspec.DecodeError as e:
                logger.warning("control plane: dropped an undecodable message (%s)", e)
                continue
            try:
                self._on_message(msg)
            except Exception:
                logger.exception("control plane: handler failed for %s", type(msg).__name__)

    def send(self, addr: str, msg: Message) -> bool:
        """Queue a message to a peer; False if it could not be queued (peer gone or closing)."""
        if self._stop.is_set():
            return False
        with self._push_lock:
            entry = self._push.get(addr)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(addr)
                entry = self._push[addr] = (sock, threading.Lock())
        sock, lock = entry
        with lock:
            try:
                sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                logger.debug("control plane: could not send %s to %s (%s)", type(msg).__name__, addr, e)
                return False

    def drop(self, addr: str) -> None:
        """Close the socket to a dead peer (a new one is made if it comes back)."""
        with self._push_lock:
            entry = self._push.pop(addr, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._push_lock:
            entries = list(self._push.values())
            self._push.clear()
        for sock, lock in entries:
            with lock:
                sock.close(0)
        self._pull.close(0)
        self._ctx.term()
