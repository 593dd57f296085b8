"""`KVSender`: the prefill side of one request (room), made by `PrefillKVManager.create_sender`.

States. Bootstrapping (waiting for `init()` and the TransferInfo of every overlapping decode rank)
-> WaitingForInput (ready, more chunks expected) -> Transferring (last chunk queued) -> Success.
Failed with a reason on: engine error, decode peer silent past the heartbeat window, no
TransferInfo within `bootstrap_timeout`, abort by either side, layout or page count mismatch, a bad
peer value, injected failure (`DISAGGREGATION_TEST_FAILURE_PROB`). The manager decides when the
room is ready (`_start`) and hands it the decode ranks it sends to (`_targets`).

Chunks. `send()` takes the next pages of the request (full pages before the last chunk; the last
adds the partial page, the state slots and the metadata row); until the sender is ready the chunks
wait in its queue. Each chunk is a job on the manager's worker threads that asks the pair's plan
for its regions (`transfer/plan.py`) and issues one engine `write()` per decode rank and pair of
memory kinds, covering all layers, K and V (on the host one write; on a GPU the device's pages and
state, then the host's metadata row). When the last chunk and all earlier ones are done, the
sender reports Success to its decode ranks.

Ordering on a GPU. Kernels run asynchronously, so a chunk handed over when the scheduler has
launched its forward may not be written yet; `send(..., ready=event)` carries the event recorded
after that forward, and the job waits on it (`synchronize()`, on the worker thread) before the
first write, instead of the scheduler synchronising the whole step.

Draining. A room that fails while chunk jobs are running stays in the manager's `_draining` until
its last job ends (a queued job returns at once, a write in progress finishes or fails); only then
are the decode ranks that aborted it sent their `AbortAck`, since until then a job could still
write into their memory.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from transfer.base import KVPoll
from transfer.control import TransferInfo
from transfer.engine import TransferError
from transfer.manager import TERMINAL, KVManager, KVRoom
from transfer.plan import Batch, write_batches

if TYPE_CHECKING:
    from transfer.sender import PrefillKVManager

logger = logging.getLogger(__name__)


@dataclass
class Chunk:
    offset: int
    pages: np.ndarray
    state_indices: np.ndarray | None
    last: bool
    ready: object = None  # the forward's completion on the device (`synchronize()`); None: written already


class KVSender(KVRoom):
    """Prefill side of one request (room): its state, its queued chunks and its chunk jobs."""

    mgr: PrefillKVManager

    def __init__(self, mgr: PrefillKVManager, room: int) -> None:
        if not isinstance(mgr, KVManager) or mgr.side != "prefill":
            raise ValueError("KVSender needs a PrefillKVManager")
        super().__init__(mgr, room)
        self.bytes_sent = 0
        self._num_pages: int | None = None
        self._metadata_index = -1
        self._targets: dict[int, TransferInfo] | None = None  # decode tp rank -> its info, once ready
        self._queued: list[Chunk] = []  # chunks sent before the sender was ready
        self._next_offset = 0
        self._outstanding = 0  # chunk jobs submitted to the workers and not finished
        self._ack_to: set[str] = set()  # decode ranks that aborted and wait for the last job to end
        self._last_enqueued = False
        with mgr._lock:
            p = mgr.settings.failure_prob
            self._inject = p > 0 and random.random() < p
            mgr._add_sender(self)

    def init(self, num_kv_pages: int, metadata_index: int) -> None:
        """Declare how many pages this request will send and its source metadata slot."""
        with self.mgr._lock:
            self._num_pages = num_kv_pages
            self._metadata_index = metadata_index
            self.mgr._check_ready(self.room)

    def send(self, page_indices, state_indices=None, last: bool = False, ready=None) -> None:
        """Queue one chunk of pages (full pages unless `last`); the last chunk also moves the state
        slots and the metadata row. Returns at once. `ready`, when given, is the device's completion of
        the forward that wrote the chunk (an event with `synchronize()`): the chunk's job waits on it
        before it reads a byte."""
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        states = None if state_indices is None else np.asarray(state_indices, dtype=np.int64).reshape(-1)
        with self.mgr._lock:
            if self._status in TERMINAL:
                return
            if self._num_pages is None:
                raise RuntimeError(f"room {self.room}: send() before init()")
            if self._last_enqueued:
                self._fail("send() after the last chunk")
                return
            if pages.size and pages.min() <= 0:
                self._fail("page 0 is the padding page and is never transferred")
                return
            end = self._next_offset + pages.size
            if end > self._num_pages:
                self._fail(f"more pages sent ({end}) than declared ({self._num_pages})")
                return
            chunk = Chunk(self._next_offset, pages, states, last, ready)
            self._next_offset = end
            if last:
                self._last_enqueued = True
                if end != self._num_pages:
                    self._fail(f"last chunk ends at {end} pages, init() declared {self._num_pages}")
                    return
            if self._targets is None:
                self._queued.append(chunk)
            else:
                if last and self._status == KVPoll.WaitingForInput:
                    self._status = KVPoll.Transferring
                self._submit(chunk)

    # ------------------------------------------------------------------ under the manager's lock
    @property
    def peer_traceparent(self) -> str | None:
        """The decode request's trace context, from its TransferInfo (--enable-trace)."""
        return next((i.traceparent for i in (self._targets or {}).values() if i.traceparent), None)

    def _start(self, targets: dict[int, TransferInfo]) -> None:
        """Every overlapping decode rank is known and checked: send the queued chunks."""
        self._targets = targets
        if self._inject:
            prob = self.mgr.settings.failure_prob
            self._fail(f"injected failure (DISAGGREGATION_TEST_FAILURE_PROB={prob})")
            return
        self._status = KVPoll.Transferring if self._last_enqueued else KVPoll.WaitingForInput
        logger.info("room %d: ready to send to decode tp ranks %s", self.room, sorted(targets))
        queued, self._queued = self._queued, []
        for chunk in queued:
            self._submit(chunk)

    def _submit(self, chunk: Chunk) -> None:
        self._outstanding += 1
        self.mgr._submit(self, chunk)

    def _fail(self, reason: str, notify: dict[int, TransferInfo] | None = None) -> None:
        """Fail the room and tell every decode rank we know of; jobs still on a worker make it drain."""
        if self._status in TERMINAL:
            return
        self._status, self._reason = KVPoll.Failed, reason
        self._queued = []
        peers = self.mgr._end_room(self.room, reason)
        if self._outstanding:
            self.mgr._draining[self.room] = self
        peers.update(notify or {})
        peers.update(self._targets or {})
        for info in peers.values():
            self.mgr._send_status(info.src, self.room, reason)
        logger.warning("room %d: sender Failed: %s", self.room, reason)

    def _ack_when_drained(self, addr: str) -> None:
        """A decode rank aborted the room: AbortAck once no job of the room can write any more."""
        if self._outstanding:
            self._ack_to.add(addr)
            logger.info("room %d: Abort from %s, AbortAck after %d chunk job(s) end", self.room, addr,
                        self._outstanding)
        else:
            self.mgr._send_ack(addr, self.room)

    # ------------------------------------------------------------------ on a worker thread
    def _run_chunk(self, chunk: Chunk) -> None:
        mgr = self.mgr
        info, handle = None, None
        try:
            if self._status in TERMINAL:
                return
            if chunk.ready is not None:
                chunk.ready.synchronize()  # the device has written the chunk's pages (a GPU node's event)
            for rank, info in self._targets.items():
                handle, batches = self._write_batches(rank, info, chunk)
                for src_kind, dst_kind, src, dst, lens in batches:
                    if self._status in TERMINAL:
                        return
                    mgr.engine.write(handle, src, dst, lens, src_kind, dst_kind)
                    with mgr._lock:
                        self.bytes_sent += sum(lens)
        except TransferError as e:
            with mgr._lock:
                self._fail(f"transfer failed: {e}")
                if info is not None:
                    mgr._forget_broken_peer(info.src, handle, str(e))
        except Exception as e:
            logger.exception("room %d: chunk job crashed", self.room)
            with mgr._lock:
                self._fail(f"transfer failed: {type(e).__name__}: {e}")
        finally:
            with mgr._lock:
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._last_job_done()

    def _write_batches(self, rank: int, info: TransferInfo, chunk: Chunk) -> tuple[str, list[Batch]]:
        """(engine peer handle, batches) of one chunk for one decode rank: kv pages, then the state slots
        and the metadata row (the last chunk), in as few batches as their memory kinds allow."""
        peer = self.mgr._decode_peers.get(info.src)
        if peer is None or peer.plan is None:
            raise TransferError(f"decode rank tp {rank} ({info.src}) is gone")
        plan = peer.plan
        n = chunk.pages.size
        dst_pages = np.asarray(info.dst_page_indices[chunk.offset: chunk.offset + n], dtype=np.int64)
        if dst_pages.size and dst_pages.min() <= 0:
            raise TransferError("page 0 is the padding page and is never transferred")
        families = [(plan.kv_memory, plan.kv_regions(chunk.pages, dst_pages))]
        if chunk.last and plan.state:  # (a pipeline stage of a hybrid model may hold no state)
            s_idx = chunk.state_indices if chunk.state_indices is not None else np.zeros(0, np.int64)
            if s_idx.size != len(info.state_indices):
                raise TransferError(f"state slot count mismatch: prefill {s_idx.size}, decode tp {rank} "
                                    f"{len(info.state_indices)}")
            families.append((plan.state_memory,
                             plan.state_regions(s_idx, np.asarray(info.state_indices, dtype=np.int64))))
        if chunk.last and info.expects_metadata and plan.aux:
            families.append((plan.aux_memory, plan.aux_regions(self._metadata_index, info.metadata_index)))
        return peer.handle, write_batches(families)

    def _last_job_done(self) -> None:
        """Under the lock: no chunk job of the room is left: Success, or the end of a failed room's drain."""
        mgr = self.mgr
        if self._status == KVPoll.Failed:
            mgr._draining.pop(self.room, None)
            for addr in sorted(self._ack_to):
                mgr._send_ack(addr, self.room)
            if self._ack_to:
                logger.info("room %d: last chunk job ended after the failure, AbortAck sent to %s", self.room,
                            sorted(self._ack_to))
            self._ack_to.clear()
        elif self._last_enqueued and self._status not in TERMINAL:
            self._status = KVPoll.Success
            mgr._end_room(self.room, None)
            for info in self._targets.values():
                mgr._send_status(info.src, self.room, None)
            logger.info("room %d: sent %d bytes, Success", self.room, self.bytes_sent)
