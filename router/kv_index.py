"""`--kv-events`: each prefill worker's exact set of cached blocks, kept from its KV events.

A worker whose `/server_info` names a `kv_events_endpoint` (a node started with `--kv-events-config`,
common/kv_events.py) gets a `WorkerView`: a SUB socket on that endpoint and, when a replay is needed, a
DEALER on its `kv_events_replay_endpoint`. A worker with DP groups (`kv_events_endpoints`, one per
group: each group has its own cache) gets a view per group, keyed `<url>#dp<k>`; `views_of(url)` lists
a worker's views in group order. One thread ("kv-events") owns every socket, so nothing here
ever waits on the router's event loop; the loop only reads `WorkerView.blocks` (set membership) and
`page_size` when it routes, and sends commands (`add`, `remove`, `resync`) through a queue.

Sequence numbers (one per batch, from 0) keep a view exact:

* on subscription, a replay from 0 rebuilds the blocks the worker still has in its replay buffer; if
  the buffer no longer starts at 0 (the worker published more batches than it keeps), the view is built
  from the oldest batch kept and marked incomplete: every block in it is really cached, some cached
  blocks are missing (`complete` turns true again at the worker's next flush, `AllBlocksCleared`);
* a gap (a sequence number past the next expected one) asks for a replay from the first missing one
  while the live batches wait; a gap the worker can no longer replay (or a replay that does not answer
  within REPLAY_TIMEOUT) clears the view and rebuilds it from what is left, marked incomplete;
* a sequence number that goes back (outside the duplicates a replay overlaps) means the worker
  restarted: the view is cleared and replayed from 0;
* a view never holds more than `max_blocks` hashes (the worker's KV capacity in pages, or
  `--kv-events-max-blocks`): past it the view is cleared and marked incomplete (`overflows`);
* frames that are not `[topic, 8-byte seq, msgpack KVEventBatch]` (or a replay's `[b"", seq, payload]`)
  are dropped and counted (`dropped_frames`), never raised. A batch is vLLM 0.32's (common/kv_events.py):
  an array `[ts, events, data_parallel_rank]` of events that are maps tagged by their "type" key; one that
  fails the schema (a missing key, a value of the wrong type, an unknown event type, an event written as
  an array as older vLLM did, nesting too deep to decode) is dropped whole; keys the schema lacks are
  ignored.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from urllib.parse import urlsplit

import msgspec
import zmq

from common.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger("router.kv_events")

# DP groups of one worker followed at most (a larger list is a bad answer: its first endpoint only)
MAX_GROUPS = 64
REPLAY_TIMEOUT = 3.0  # seconds without a replay message before the replay is given up
MAX_FRAME = 64 * 2**20  # a larger event frame is dropped by ZMQ (MAXMSGSIZE) before it is read
MAX_PENDING = 10_000  # live batches kept while a replay runs; past it (or MAX_PENDING_BYTES) they are dropped
MAX_PENDING_BYTES = 256 * 2**20
# every counter of a view, present from the start: the event loop copies them while the thread counts
COUNTERS = ("batches", "dropped_frames", "gaps", "replays", "replay_failures",
            "unreplayable_gaps", "restarts", "resyncs", "overflows", "pending_dropped")
_DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode
_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")


def resolve_endpoint(endpoint: str, worker_url: str) -> str:
    """A worker's endpoint as the router connects to it: a wildcard host (`tcp://*:5557`) is the host of
    the worker's URL."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in _WILDCARDS:
        h = urlsplit(worker_url).hostname or "127.0.0.1"
        host = f"[{h}]" if ":" in h else h
    return f"tcp://{host}:{port}"


class WorkerView:
    """One worker's cached blocks and the state of its event stream."""

    def __init__(self, url: str, endpoint: str, replay_endpoint: str | None, topic: str, page_size: int,
                 max_blocks: int, dp_rank: int = 0, dp_size: int = 1):
        self.url = url
        self.dp_rank = dp_rank  # the worker's DP group whose cache this is (of dp_size)
        self.key = url if dp_size == 1 else f"{url}#dp{dp_rank}"
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.page_size = page_size
        self.max_blocks = max_blocks
        self.blocks: set[int] = set()
        self.complete = False  # every block the worker holds is in `blocks` (else only some of them)
        self.synced = False  # the first replay is done
        self.next_seq: int | None = None
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        # owned by the kv-events thread
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.replay_start = 0
        self.replay_clear = False
        self.replay_first: int | None = None
        self.replay_deadline = 0.0
        self.pending: list[tuple[int, bytes]] = []
        self.pending_bytes = 0
        self.dup_from, self.dup_until = 0, -1

    def matched_blocks(self, hashes: list[int], extra=None) -> int:
        """How many leading blocks of `hashes` the worker holds (or `extra` predicts)."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h in blocks or (extra is not None and h in extra):
                n += 1
            else:
                break
        return n

    def describe(self) -> dict:
        return {"dp_rank": self.dp_rank, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "page_size": self.page_size,
                "blocks": len(self.blocks), "max_blocks": self.max_blocks, "complete": self.complete,
                "synced": self.synced, "next_seq": self.next_seq, **dict(self.counters)}


class KVEventIndex:
    """Every subscribed worker's view, kept by one thread."""

    def __init__(self, max_blocks: int | None = None):
        self.max_blocks = max_blocks
        self.views: dict[str, WorkerView] = {}
        self._commands: queue.Queue = queue.Queue()
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._owner: dict[zmq.Socket, WorkerView] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the event loop's side
    def views_of(self, url: str) -> list[WorkerView]:
        """A worker's views, one per DP group in group order (none when it publishes no events)."""
        return sorted((v for v in list(self.views.values()) if v.url == url), key=lambda v: v.dp_rank)

    def urls(self) -> set[str]:
        return {v.url for v in list(self.views.values())}

    def subscribe(self, url: str, server_info: dict) -> list[WorkerView]:
        """Follow a worker's events if its server_info names an endpoint (one per DP group when it lists
        `kv_events_endpoints`), replacing its previous views."""
        self.unsubscribe(url)
        endpoints = server_info.get("kv_events_endpoints")
        replays = server_info.get("kv_events_replay_endpoints")
        if not (isinstance(endpoints, list) and 1 < len(endpoints) <= MAX_GROUPS):
            endpoints, replays = [server_info.get("kv_events_endpoint")], [
                server_info.get("kv_events_replay_endpoint")]
        if not isinstance(replays, list) or len(replays) != len(endpoints):
            replays = [None] * len(endpoints)
        if not all(isinstance(e, str) and e.startswith(("tcp://", "ipc://")) for e in endpoints):
            return []
        return [self._add(url, server_info, e, r, k, len(endpoints))
                for k, (e, r) in enumerate(zip(endpoints, replays, strict=True))]

    def _add(self, url: str, server_info: dict, endpoint: str, replay, dp_rank: int,
             dp_size: int) -> WorkerView:
        replay = resolve_endpoint(replay, url) if isinstance(replay, str) and replay else None
        topic = server_info.get("kv_events_topic")
        page_size = server_info.get("page_size")
        page_size = page_size if isinstance(page_size, int) and page_size > 0 else 1
        limit = self.max_blocks
        if limit is None:
            total = server_info.get("max_total_num_tokens")
            # a radix cache holds at most every page of the pool (slack for a view ahead of evictions)
            limit = 2 * (total // page_size) + 1024 if isinstance(total, int) and total > 0 else 1 << 22
        view = WorkerView(url, resolve_endpoint(endpoint, url), replay,
                          topic if isinstance(topic, str) else "", page_size, limit, dp_rank, dp_size)
        self.views[view.key] = view
        self._commands.put(("add", view))
        log.info("following the KV events of %s at %s (replay %s, page size %d, at most %d blocks)", view.key,
                 view.endpoint, replay or "none", page_size, limit)
        return view

    def unsubscribe(self, url: str) -> None:
        for view in self.views_of(url):
            self.views.pop(view.key, None)
            self._commands.put(("remove", view))

    def resync(self, url: str) -> None:
        for view in self.views_of(url):
            self._commands.put(("resync", view))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the kv-events thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_commands()
                ready = dict(self._poller.poll(50))
                for sock in ready:
                    view = self._owner.get(sock)
                    if view is None:
                        continue
                    for _ in range(1000):  # bounded per round: one busy worker cannot starve the others
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if sock is view.sub:
                            self._on_live(view, frames)
                        elif sock is view.dealer:
                            self._on_replay(view, frames)
                            if view.dealer is not sock:
                                break
                now = time.monotonic()
                for view in list(self._owner.values()):
                    if view.dealer is not None and now > view.replay_deadline:
                        self._replay_failed(view, "timed out")
        except Exception:
            log.exception("the KV event subscriber stopped; routing falls back to load for these workers")
            for view in list(self.views.values()):
                view.blocks = set()
                view.complete = False
        finally:
            for sock in list(self._owner):
                sock.close(linger=0)
            self._ctx.term()

    def _take_commands(self) -> None:
        while True:
            try:
                cmd, view = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                for old in [v for v in self._owner.values() if v.key == view.key and v is not view]:
                    self._close_view(old)
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, 100_000)
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
                sub.setsockopt(zmq.SUBSCRIBE, view.topic.encode())
                try:
                    sub.connect(view.endpoint)
                except zmq.ZMQError as e:
                    log.warning("cannot subscribe to %s of %s: %s", view.endpoint, view.url, e)
                    sub.close()
                    continue
                view.sub = sub
                self._owner[sub] = view
                self._poller.register(sub, zmq.POLLIN)
                self._start_replay(view, 0, clear=True)
            elif cmd == "remove":
                self._close_view(view)
            elif cmd == "resync" and view.sub is not None:
                view.counters["resyncs"] += 1
                self._drop_dealer(view)
                self._start_replay(view, 0, clear=True)

    def _close_view(self, view: WorkerView) -> None:
        self._drop_dealer(view)
        if view.sub is not None:
            self._poller.unregister(view.sub)
            self._owner.pop(view.sub, None)
            view.sub.close(linger=0)
            view.sub = None
        view.blocks = set()

    def _drop_dealer(self, view: WorkerView) -> None:
        if view.dealer is not None:
            self._poller.unregister(view.dealer)
            self._owner.pop(view.dealer, None)
            view.dealer.close(linger=0)
            view.dealer = None

    @staticmethod
    def _clear(view: WorkerView, complete: bool) -> None:
        view.blocks = set()
        view.complete = complete

    # --- live batches
    def _on_live(self, view: WorkerView, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            view.counters["dropped_frames"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if view.dealer is not None:  # a replay runs: keep the batch for after it
            if len(view.pending) >= MAX_PENDING or view.pending_bytes > MAX_PENDING_BYTES:
                view.pending.clear()  # the next batch after the replay shows the gap again
                view.pending_bytes = 0
                view.counters["pending_dropped"] += 1
            view.pending.append((seq, frames[2]))
            view.pending_bytes += len(frames[2])
            return
        self._on_seq(view, seq, frames[2])

    def _on_seq(self, view: WorkerView, seq: int, payload: bytes) -> None:
        nxt = view.next_seq
        if nxt is None or seq == nxt:  # nothing to continue from (a failed replay): start here
            self._apply(view, payload)
            view.next_seq = seq + 1
            if seq > view.dup_until:
                view.dup_until = -1
        elif seq > nxt:
            view.counters["gaps"] += 1
            view.pending.append((seq, payload))
            self._start_replay(view, nxt, clear=False)
        elif view.dup_from <= seq <= view.dup_until:
            return  # a batch the replay already gave
        else:
            log.info("KV events of %s went back from seq %d to %d: the worker restarted; replaying", view.url,
                     nxt - 1, seq)
            view.counters["restarts"] += 1
            view.pending.append((seq, payload))
            self._start_replay(view, 0, clear=True)

    def _apply(self, view: WorkerView, payload: bytes) -> None:
        try:
            batch = _DECODE(payload)
        # RecursionError: nesting too deep
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            view.counters["dropped_frames"] += 1
            return
        view.counters["batches"] += 1
        blocks = view.blocks
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.block_size > 0 and ev.block_size != view.page_size:
                    log.warning("KV events of %s: block size %d, not the page size %d it reported; using %d",
                                view.url, ev.block_size, view.page_size, ev.block_size)
                    view.page_size = ev.block_size
                if len(blocks) + len(ev.block_hashes) > view.max_blocks:
                    self._clear(view, False)
                    blocks = view.blocks
                    # counted once the view is cleared: a reader that sees the count sees the cleared view
                    view.counters["overflows"] += 1
                    log.warning("KV events of %s: more than %d blocks; view cleared",
                                view.url, view.max_blocks)
                    if len(ev.block_hashes) > view.max_blocks:
                        continue
                blocks.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                blocks.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(view, True)
                blocks = view.blocks

    # --- replays
    def _start_replay(self, view: WorkerView, start: int, clear: bool) -> None:
        self._drop_dealer(view)
        view.replay_start, view.replay_clear, view.replay_first = start, clear, None
        if view.replay_endpoint is None:
            self._replay_failed(view, "no replay endpoint")
            return
        view.counters["replays"] += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        try:
            dealer.connect(view.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            dealer.close(linger=0)
            self._replay_failed(view, str(e))
            return
        view.dealer = dealer
        self._owner[dealer] = view
        self._poller.register(dealer, zmq.POLLIN)
        view.replay_deadline = time.monotonic() + REPLAY_TIMEOUT

    def _on_replay(self, view: WorkerView, frames: list[bytes]) -> None:
        view.replay_deadline = time.monotonic() + REPLAY_TIMEOUT
        if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
            view.counters["dropped_frames"] += 1
            return
        if frames[1] == END_SEQ:
            self._end_replay(view)
            return
        seq = int.from_bytes(frames[1], "big")
        if view.replay_first is None:
            view.replay_first = seq
            if view.replay_clear:
                self._clear(view, True)
                view.next_seq = view.replay_start
            if seq > view.replay_start:  # the worker no longer has what we missed: rebuild from what it has
                view.counters["unreplayable_gaps"] += 1
                self._clear(view, False)
                view.next_seq = seq
        if view.next_seq is None or seq == view.next_seq:
            self._apply(view, frames[2])
            view.next_seq = seq + 1
        elif seq > view.next_seq:  # a hole inside a replay: cannot happen with a sound publisher
            view.counters["unreplayable_gaps"] += 1
            self._clear(view, False)
            self._apply(view, frames[2])
            view.next_seq = seq + 1

    def _end_replay(self, view: WorkerView) -> None:
        self._drop_dealer(view)
        # nothing kept: the worker holds nothing we know of
        if view.replay_first is None and view.replay_clear:
            self._clear(view, view.replay_start == 0)
            view.next_seq = view.replay_start
        view.synced = True
        view.dup_from, view.dup_until = view.replay_start, (view.next_seq or 0) - 1
        self._drain_pending(view)

    def _replay_failed(self, view: WorkerView, why: str) -> None:
        self._drop_dealer(view)
        view.counters["replay_failures"] += 1
        log.warning("KV event replay from %s failed (%s): its view is rebuilt from the "
                    "live events", view.url, why)
        self._clear(view, False)
        view.next_seq = None
        view.synced = True
        view.dup_until = -1
        self._drain_pending(view)

    def _drain_pending(self, view: WorkerView) -> None:
        pending, view.pending = view.pending, []  # in arrival order: one PUB socket keeps the order
        view.pending_bytes = 0
        for i, (seq, payload) in enumerate(pending):
            if view.dealer is not None:  # a new replay started: keep the rest for after it
                view.pending.extend(pending[i:])
                return
            if view.next_seq is not None and seq > view.next_seq:  # the replay could not fill this gap
                view.counters["unreplayable_gaps"] += 1
                self._clear(view, False)
                view.next_seq, view.dup_until = seq, -1
            self._on_seq(view, seq, payload)  # what the replay gave already is in its duplicate window
