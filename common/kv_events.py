"""KV cache events: what a node's prefix cache holds, published for routers (`--kv-events-config`).

Wire format: vLLM 0.32's ZMQ event publisher's, so its own subscriber (`KVEventBatch` decoded with
msgspec) and the consumers written for it read ours:

* a PUB socket sends three frames per batch: topic, an 8-byte big-endian sequence number (0, 1, ...),
  and the msgpack of a `KVEventBatch`, an array `[ts, events, data_parallel_rank]` (the rank is nil
  unless the node has several DP groups; a consumer that knows only the first two ignores it);
* each event is a msgpack map whose "type" key names it:
  - "BlockStored": always `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
    `medium` and `lora_name` (nil where pdserve has no value), and here also `group_idx` and
    `kv_cache_spec_kind` (`kv_cache_spec_sliding_window` too for a sliding-window cache);
  - "BlockRemoved": `block_hashes`, `medium`, `group_idx`;
  - "AllBlocksCleared": no other key;
  the schema's other optional keys (`extra_keys`, `locality`, `ownership`, `session_id`) have no value
  in pdserve and are left out, as vLLM leaves out every optional key it has no value for;
* a ROUTER socket answers a replay request (one frame after the delimiter: the first wanted sequence
  number, 8 bytes big-endian) with one message `[seq, payload]` per batch still in the buffer from
  that number on, then `[-1 as 8 signed bytes, b""]`.

A block is one page of the radix cache. Its hash chains from its parent's: the first 8 bytes of
SHA-256 over the parent's hash and the page's token ids, as a non-negative 63-bit int, so two nodes
caching the same prefix publish the same hashes. The values pdserve fills in: `block_size` is the page
size; `lora_id` and `lora_name` are nil (no LoRA adapters); `medium` is "CPU" (the KV lives in host
memory); `group_idx` is 0, the one cache group (every layer's KV in the same pages); `kv_cache_spec_kind`
is "sliding_window", with the window in tokens as `kv_cache_spec_sliding_window`, when every layer of
the model is windowed, else "full_attention" (a model with some full-attention layers needs every page
of a prefix, like full attention). Hybrid models (linear-attention state) run without a radix cache, so
they publish no events.

Config (a JSON object, keys as vLLM/SGLang name them): `publisher` ("zmq" or "null"), `endpoint`
(default `tcp://<--host>:5557`: like every listener of a node it binds only the address it is given;
write `tcp://*:5557` to serve every interface), `replay_endpoint` (default: the endpoint's port + 1),
`topic` (""), `buffer_steps` (batches kept for replay, 10000), `hwm` (100000), `max_queue_size`
(batches waiting for the publisher thread, 100000: past it a batch is dropped and counted, the
scheduler never waits). Only TP rank 0 publishes; the ranks' caches are identical.

With --dp-size N every DP group has its own cache and publishes on its own sockets, as vLLM numbers
them: group k's endpoint is the configured port + k (an ipc path gets `_dp<k>`), its batches carry
`data_parallel_rank` k. The default replay port is then the endpoint's port + N (+ k for group k),
so no group's replay socket takes another's endpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass, fields

import msgspec
import zmq

logger = logging.getLogger("kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "CPU"
GROUP = 0  # the cache group of every block: one radix cache holds every layer's pages


# ---------------------------------------------------------------------------------------------- wire
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event on the wire: a map, its "type" key the class name (a field with a default is left out
    while it has it; the others are always there)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None  # the publishing DP group with --dp-size > 1 (nil otherwise)


def block_hash(parent: int | None, token_ids) -> int:
    """The chained hash of one page: parent's hash (or none at the root) and its token ids."""
    h = hashlib.sha256(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def chain_hashes(parent: int | None, token_ids, page_size: int) -> list[int]:
    out = []
    for i in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[i:i + page_size])
        out.append(parent)
    return out


# ---------------------------------------------------------------------------------------------- config
@dataclass
class KVEventsConfig:
    publisher: str = "zmq"
    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    enable_kv_cache_events: bool = True

    @classmethod
    def parse(cls, raw: str, host: str, dp_size: int = 1) -> KVEventsConfig:
        """From the `--kv-events-config` JSON (of a node with `dp_size` groups); raises ValueError naming
        the key."""
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        cfg = cls(**data)
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        for key in ("publisher", "endpoint", "replay_endpoint", "topic"):
            if not isinstance(getattr(cfg, key), str):
                raise ValueError(f"{key} must be a string")
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be true or false")
        cfg.endpoint = cfg.endpoint or f"tcp://{_bracket(host)}:5557"
        if not cfg.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint must be tcp://HOST:PORT or ipc://PATH, got {cfg.endpoint!r}")
        if not cfg.replay_endpoint and cfg.endpoint.startswith("tcp://"):
            base, _, port = cfg.endpoint.rpartition(":")
            if not port.isdigit():
                raise ValueError(f"endpoint needs a port, got {cfg.endpoint!r}")
            cfg.replay_endpoint = f"{base}:{int(port) + dp_size}"
        for key in ("endpoint", "replay_endpoint"):  # every group's port must exist
            if getattr(cfg, key):
                offset_endpoint(getattr(cfg, key), dp_size - 1)
        return cfg

    def for_dp_rank(self, dp_rank: int) -> KVEventsConfig:
        """The sockets of DP group `dp_rank`."""
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, dp_rank),
                                   replay_endpoint=offset_endpoint(self.replay_endpoint, dp_rank))

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """`endpoint` of DP group `dp_rank`: a tcp port + dp_rank, an ipc path + `_dp<rank>` (vLLM's
    numbering)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{dp_rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) + dp_rank > 65535:
        raise ValueError(f"{endpoint!r} has no port for DP rank {dp_rank} (port + rank must be <= 65535)")
    return f"{base}:{int(port) + dp_rank}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---------------------------------------------------------------------------------------------- publisher
class KVEventPublisher:
    """Collects a scheduler step's events (`stored`, `removed`, `cleared`, called by the radix
    cache) and, at `flush()`, hands them as one batch to a thread that owns the sockets."""

    def __init__(self, cfg: KVEventsConfig, page_size: int, dp_rank: int | None = None,
                 sliding_window: int | None = None) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.dp_rank = dp_rank  # set with --dp-size > 1: every batch names its group
        # the model's window when every layer is windowed (`model.kv_window()`), else None
        self.sliding_window = sliding_window
        self.kind = "sliding_window" if sliding_window else "full_attention"
        self.pending: list = []
        self.batches_published = 0
        self.batches_dropped = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(cfg.endpoint)
        self._replay = None
        if cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(cfg.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay %s, topic %r)", cfg.endpoint,
                    cfg.replay_endpoint or "off", cfg.topic)

    # the radix cache's sink
    def stored(self, hashes: list[int], parent: int | None, token_ids) -> None:
        self.pending.append(BlockStored(hashes, parent, list(token_ids), self.page_size, None, MEDIUM, None,
                                        group_idx=GROUP, kv_cache_spec_kind=self.kind,
                                        kv_cache_spec_sliding_window=self.sliding_window))

    def removed(self, hashes: list[int]) -> None:
        self.pending.append(BlockRemoved(hashes, MEDIUM, group_idx=GROUP))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def flush(self) -> None:
        """Publish what this step recorded, as one batch (never blocks: a full queue drops it)."""
        if not self.pending:
            return
        payload = self._encoder.encode(KVEventBatch(time.time(), self.pending, self.dp_rank))
        self.pending = []
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.batches_dropped += 1
            logger.warning("KV event queue full (max_queue_size %d): a batch was dropped",
                           self.cfg.max_queue_size)

    def stats(self) -> dict[str, int]:
        return {"kv_events_published": self.batches_published, "kv_events_dropped": self.batches_dropped}

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)

    # the publisher thread: the only user of the sockets
    def _run(self) -> None:
        topic = self.cfg.topic.encode()
        buffer: collections.deque[tuple[bytes, bytes]] = collections.deque(maxlen=self.cfg.buffer_steps)
        seq = 0
        try:
            while True:
                self._serve_replays(buffer)
                try:
                    payload = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if payload is None:
                    return
                seq_bytes = seq.to_bytes(8, "big")
                self.batches_published += 1  # counted first: a subscriber never sees a batch the stats miss
                self._pub.send_multipart((topic, seq_bytes, payload))
                buffer.append((seq_bytes, payload))
                seq += 1
        except Exception:
            logger.exception("the KV event publisher stopped")
        finally:
            for s in (self._pub, self._replay):
                if s is not None:
                    s.close()
            self._ctx.term()

    def _serve_replays(self, buffer) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("dropped a malformed replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq_bytes, payload in list(buffer):
                if int.from_bytes(seq_bytes, "big") >= start:
                    self._replay.send_multipart((client, b"", seq_bytes, payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
