"""Prefill side of the transfer protocol: `PrefillKVManager` and a `KVSender` per request (room).

Peers. A decode rank registers once (`RegisterPeer`: its engine description, buffer addresses, item
sizes and strides, TP place); the manager checks the layout against its own, adds the peer to the
engine off the control plane's thread (which must keep answering heartbeats) and builds the
pair's region plan (`transfer/plan.py`). Then the decode rank sends a `TransferInfo` per room.

Peer values. Nothing a peer sends is used unchecked (`transfer/peer_checks.py`): a registration must
be consistent with this rank's layout (else it is kept with its error and every room that names it
fails with it); a TransferInfo must come from a registered rank, with its registered TP place,
destination pages within 1 .. its pool's pages - 1 without duplicates, a metadata row and state
slots it has. A bad TransferInfo fails its room (Status with the reason to the sender) unless
another rank already holds that room's place, then it is only dropped; both are counted
(`rejected_peer_values`).

Parallel layouts. A sender waits for the `TransferInfo` of every decode rank whose kv heads overlap
this rank's; each info says whether that decode rank expects this rank to write its metadata row
(the lowest overlapping tp rank of the last pp stage does).

Chunks. `send()` takes the next pages of the request (full pages before the last chunk; the last
adds the partial page, the state slots and the metadata row); until the sender is ready the chunks
wait in its queue. Each chunk is a job on the manager's worker threads that asks the plan for its
regions and issues one engine `write()` per decode rank and pair of memory kinds, covering all
layers, K and V (on the host one write; on a GPU the device's pages and state, then the host's
metadata row). Ordering on a GPU: kernels run asynchronously, so a chunk handed over when the
scheduler has launched its forward may not be written yet; `send(..., ready=event)` carries the
event recorded after that forward, and the job waits on it (`synchronize()`, on the worker thread)
before the first write, instead of the scheduler synchronising the whole step. When the
last chunk and all earlier ones are done, the sender reports Success to its decode ranks.

States. Bootstrapping (waiting for `init()` and the TransferInfo of every overlapping decode rank)
-> WaitingForInput (ready, more chunks expected) -> Transferring (last chunk queued) -> Success.
Failed with a reason on: engine error, decode peer silent past the heartbeat window, no
TransferInfo within `bootstrap_timeout`, abort by either side, layout or page count mismatch, a bad
peer value, injected failure (`DISAGGREGATION_TEST_FAILURE_PROB`).

Aborts. An `Abort` counts only from a decode rank whose TransferInfo the room holds; one that comes
before any TransferInfo of the room is recorded for that rank alone (its TransferInfo, if it comes,
fails the room); any other is dropped and counted. Every Abort is answered with an `AbortAck` as
soon as no chunk job of the room can write into that decode rank's memory any more: at once when
the room never started or has no job left, else when its last job (queued jobs return at once, a
write in progress finishes or fails) is done. Until then the decode keeps the room's pages out of use.

The manager remembers how recent rooms ended, so a TransferInfo, an Abort or a `KVSender` that
arrives after its room ended still gets the room's outcome.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from transfer.base import KVArgs, KVPoll, TransferSettings
from transfer.bootstrap import BootstrapError
from transfer.control import Abort, AbortAck, Message, RegisterPeer, Status, TransferInfo
from transfer.engine import TransferEngine, TransferError
from transfer.manager import TERMINAL, KVManager, KVRoom
from transfer.peer_checks import check_info, check_registration, reject
from transfer.plan import PairPlan, ranks_overlapping

logger = logging.getLogger(__name__)

_FINISHED_CAP = 20000


@dataclass
class _DecodePeer:
    reg: RegisterPeer
    handle: str
    error: str | None
    plan: PairPlan | None
    ready: bool = True


@dataclass
class _Chunk:
    offset: int
    pages: np.ndarray
    state_indices: np.ndarray | None
    last: bool
    ready: object = None  # the forward's completion on the device (`synchronize()`); None: written already


class PrefillKVManager(KVManager):
    """One per prefill rank; `bootstrap_addr` ("host:port" of its node's bootstrap server) is where
    it registers. `create_sender(room)` makes a room's `KVSender`."""

    side = "prefill"
    peer_side = "decode"

    def __init__(self, args: KVArgs, backend: str | TransferEngine = "mooncake",
                 settings: TransferSettings | None = None, host: str = "127.0.0.1",
                 bootstrap_addr: str | None = None, **overrides) -> None:
        if not bootstrap_addr:
            raise ValueError("a PrefillKVManager needs bootstrap_addr (its node's bootstrap server)")
        self.bootstrap_addr = bootstrap_addr
        super().__init__(args, backend, settings, host, **overrides)

    def create_sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    # ------------------------------------------------------------------ side hooks
    def _init_side(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self.settings.num_workers, thread_name_prefix="kv-prefill")
        self._register_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefill-register")
        self._decode_peers: dict[str, _DecodePeer] = {}
        self._infos: dict[int, dict[int, TransferInfo]] = {}  # room -> decode tp rank -> info, until ready
        self._info_time: dict[int, float] = {}
        self._senders: dict[int, KVSender] = {}
        self._finished: OrderedDict[int, str | None] = OrderedDict()  # room -> failure reason (None: Success)
        self._draining: dict[int, KVSender] = {}  # failed rooms whose chunk jobs are still running
        self._early_aborts: dict[int, dict[str, str]] = {}  # room -> decode rank -> reason, before any info
        self._early_time: dict[int, float] = {}
        self.rejected_peer_values = 0

    def _start_side(self) -> None:
        a = self.args
        info = {"role": "prefill", "tp_rank": a.engine_rank, "tp_size": a.tp_size, "dp_rank": a.dp_rank,
                "dp_size": a.dp_size, "pp_rank": a.pp_rank, "pp_size": a.pp_size, "rank_ip": self.host,
                "rank_port": self.control.port, "page_size": a.page_size, "model": a.model,
                "kv_layout": a.kv_layout, "kv_heads_total": a.total_kv_heads, "fingerprint": a.fingerprint}
        deadline = time.monotonic() + 30.0
        while True:
            try:
                self.bootstrap.register(self.bootstrap_addr, info)
                return
            except BootstrapError:
                self.control.close()
                raise
            except OSError as e:
                if time.monotonic() > deadline:
                    self.control.close()
                    raise BootstrapError(f"bootstrap server {self.bootstrap_addr} unreachable: {e}") from e
                time.sleep(0.1)

    def _close_side(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._register_pool.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self, msg: Message) -> None:
        try:
            if isinstance(msg, RegisterPeer):
                self._on_register(msg)
            elif isinstance(msg, TransferInfo):
                self._on_info(msg)
            elif isinstance(msg, Abort):
                self._on_abort(msg)
        except Exception as e:  # a value no check foresaw: fail that room, keep serving
            logger.exception("room %s: %s from %s could not be handled", getattr(msg, "room", "-"),
                             type(msg).__name__, msg.src)
            room = getattr(msg, "room", None)
            with self._lock:
                sender = self._senders.get(room)
                if sender is not None:
                    sender._fail(f"{type(msg).__name__} from {msg.src} could not be handled: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ decode peers
    def _on_register(self, reg: RegisterPeer) -> None:
        """Record the peer at once (so its TransferInfo can queue) and add it to the engine off the
        receiver thread, which must keep answering heartbeats. A registration that differs from the
        one a peer with live or pending rooms made is refused: it would redirect their writes."""
        with self._lock:
            old = self._decode_peers.get(reg.src)
            if old is not None and old.reg != reg and self._has_rooms_with(reg.src):
                self.registrations_refused += 1
                logger.warning("decode peer %s: refused a RegisterPeer that differs from its registration while "
                               "it has live rooms", reg.src)
                return
            if old is None and not self._make_room_for_peer(reg.src):
                return
            self._decode_peers.pop(reg.src, None)  # re-inserted: the newest registration is evicted last
            self._decode_peers[reg.src] = _DecodePeer(reg, "", None, None, ready=False)
        self._register_pool.submit(self._complete_register, reg)

    def _complete_register(self, reg: RegisterPeer) -> None:
        try:
            error = check_registration(self.args, reg)
        except Exception as e:  # a value of a type no check foresaw
            error = f"RegisterPeer could not be checked: {type(e).__name__}: {e}"
        handle, plan = "", None
        if error is None:
            try:
                handle = self.engine.add_peer(reg.engine_desc)
                plan = PairPlan(self.args, reg)
            except Exception as e:  # engine could not reach or parse the peer
                error = f"engine could not add decode peer: {e}"
        if error:
            reject(self, f"RegisterPeer from {reg.src} (tp {reg.tp_rank})", error)
        else:
            logger.info("decode peer %s registered (tp %d/%d)", reg.src, reg.tp_rank, reg.tp_size)
        with self._lock:
            peer = self._decode_peers.get(reg.src)
            if peer is None or peer.reg is not reg:
                return  # forgotten (declared dead) or re-registered meanwhile
            peer.handle, peer.error, peer.plan, peer.ready = handle, error, plan, True
            for room, infos in list(self._infos.items()):
                if any(i.src == reg.src for i in infos.values()):
                    try:
                        self._check_ready(room)
                    except Exception as e:  # that room fails; the registration thread goes on
                        logger.exception("room %d: could not start after %s registered", room, reg.src)
                        self._fail_room(room, f"could not start: {type(e).__name__}: {e}", {})

    def _make_room_for_peer(self, src: str) -> bool:
        """Under the lock: keep at most `max_decode_peers` registrations (whatever unauthenticated peers
        send). When full, a refused registration (bad layout, an engine description that did not work)
        makes room, as it serves no one; otherwise the new one is refused and counted, and a live decode
        rank's registration is never dropped for a stranger's (idle ones expire after
        PDSERVE_PEER_IDLE_TIMEOUT)."""
        cap = self.settings.max_decode_peers
        while len(self._decode_peers) >= cap:
            refused = next((a for a, p in self._decode_peers.items() if p.ready and p.error), None)
            if refused is None:
                self.registrations_refused += 1
                logger.warning("decode peer %s: registration refused, %d decode ranks registered "
                               "(PDSERVE_MAX_DECODE_PEERS)", src, cap)
                return False
            self.registrations_evicted += 1
            self._drop_decode_peer(refused)
        return True

    def _drop_decode_peer(self, addr: str) -> None:
        """Under the lock: forget a decode rank; its engine peer is removed on the registration thread
        (closing an endpoint may block, and this runs on the control or timer thread)."""
        peer = self._decode_peers.pop(addr, None)
        if peer is not None and peer.handle:
            try:
                self._register_pool.submit(self._remove_engine_peer, addr, peer.handle)
            except RuntimeError:  # closing: the engine's close() drops every peer
                pass

    def _forget_broken_peer(self, addr: str, handle, reason: str) -> None:
        """Under the lock: a write to this decode rank failed. Its connection may be broken for good (nixl
        keeps a disconnected endpoint after a partition heals), so its registration and engine peer go:
        its next room finds it unregistered, it registers again and the engine connects afresh."""
        peer = self._decode_peers.get(addr)
        if peer is not None and peer.handle == handle:
            logger.warning("decode peer %s: a write failed (%s); forgotten until it registers again", addr, reason)
            self._drop_decode_peer(addr)

    def _remove_engine_peer(self, addr: str, handle) -> None:
        try:
            self.engine.remove_peer(handle)
        except Exception as e:
            logger.warning("engine could not remove decode peer %s: %s", addr, e)

    def _on_peer_dead(self, addr: str, rooms: list[KVSender], reason: str) -> None:
        for sender in rooms:
            sender._fail(reason)
        self._drop_decode_peer(addr)

    def _is_known_peer(self, addr: str) -> bool:
        return addr in self._decode_peers

    def _idle_registered(self, live: dict[str, list]) -> set[str]:
        waiting = {i.src for infos in self._infos.values() for i in infos.values()}
        return {a for a in self._decode_peers if a not in live and a not in waiting}

    def _expire_peer(self, addr: str) -> None:
        self._drop_decode_peer(addr)

    def _room_stats(self) -> dict[str, int]:
        return {"transfer_rooms_open": len(self._senders), "transfer_rooms_draining": len(self._draining),
                "transfer_rooms_pending_info": len(self._infos), "transfer_early_aborts": len(self._early_aborts),
                "transfer_peers_registered": len(self._decode_peers)}

    def _has_rooms_with(self, addr: str) -> bool:
        """Under the lock: a started room sends to `addr`, or a room's TransferInfo from it waits."""
        return addr in self._live_peers() or any(i.src == addr for infos in self._infos.values()
                                                  for i in infos.values())

    def _live_peers(self) -> dict[str, list[KVSender]]:
        live: dict[str, list[KVSender]] = {}
        for sender in self._senders.values():
            if sender._targets:
                for info in sender._targets.values():
                    live.setdefault(info.src, []).append(sender)
        return live

    # ------------------------------------------------------------------ rooms
    def _send_status(self, addr: str, room: int, reason: str | None, unregistered: bool = False) -> None:
        """Tell a decode rank how the room ended here (reason None: Success)."""
        self.control.send(addr, Status(src=self.address, room=room, ok=reason is None, reason=reason or "",
                                       tp_rank=self.args.engine_rank, pp_rank=self.args.pp_rank,
                                       unregistered=unregistered))

    def _send_ack(self, addr: str, room: int) -> None:
        """Tell a decode rank that no chunk job of `room` can write into its memory any more."""
        self.control.send(addr, AbortAck(src=self.address, room=room, tp_rank=self.args.engine_rank,
                                         pp_rank=self.args.pp_rank))

    def _on_info(self, info: TransferInfo) -> None:
        with self._lock:
            room = info.room
            if room in self._finished:
                reason = self._finished[room]
                if reason is not None:
                    self._send_status(info.src, room, reason)
                return
            peer = self._decode_peers.get(info.src)
            if peer is None:
                reason = "decode rank is not registered with this prefill rank (prefill restarted or peer evicted)"
                reject(self, f"TransferInfo for room {room} from {info.src}", reason)
                self._send_status(info.src, room, reason, unregistered=True)
                return
            infos = self._infos.get(room, {})
            held = infos.get(info.tp_rank)
            sender = self._senders.get(room)
            if (held is not None and held.src != info.src) or (sender is not None and sender._targets is not None):
                why = (f"decode tp {info.tp_rank} of this room is {held.src}" if held is not None and held.src != info.src
                       else "the room is already transferring")
                reject(self, f"TransferInfo for room {room} from {info.src}", why)
                return
            reg_error = peer.error if peer.ready else check_registration(self.args, peer.reg)
            problem = f"decode rank's registration was rejected: {reg_error}" if reg_error else check_info(peer.reg, info)
            if problem is None and info.src in self._early_aborts.get(room, {}):
                problem = f"aborted by the decode side: {self._early_aborts[room][info.src]}"
            if problem is not None:
                reject(self, f"TransferInfo for room {room} from {info.src}", problem)
                self._fail_room(room, problem, {info.tp_rank: info})
                return
            self._infos.setdefault(room, {})[info.tp_rank] = info
            self._info_time.setdefault(room, time.monotonic())
            logger.info("room %d: TransferInfo from decode tp %d (%d pages)", room, info.tp_rank,
                        len(info.dst_page_indices))
            self._check_ready(room)

    def _fail_room(self, room: int, reason: str, notify: dict[int, TransferInfo]) -> None:
        """Under the lock: fail a room that has not started, with or without its sender yet."""
        sender = self._senders.get(room)
        if sender is not None:
            sender._fail(reason, notify=notify)
            return
        peers = {**self._infos.pop(room, {}), **notify}
        self._info_time.pop(room, None)
        self._remember(room, reason)
        for info in peers.values():
            self._send_status(info.src, room, reason)
        logger.info("room %d: failed before its sender existed: %s", room, reason)

    def _on_abort(self, msg: Abort) -> None:
        with self._lock:
            room, src = msg.room, msg.src
            reason = f"aborted by the decode side: {msg.reason}"
            sender = self._senders.get(room) or self._draining.get(room)
            if sender is not None and sender._targets is not None:
                if any(i.src == src for i in sender._targets.values()):
                    sender._fail(reason)
                    sender._ack_when_drained(src)
                    return
                reject(self, f"Abort for room {room} from {src}", "not a decode rank of this room")
            elif room not in self._finished:
                claimants = {i.src for i in self._infos.get(room, {}).values()}
                if src in claimants:
                    self._fail_room(room, reason, {})
                elif claimants or src not in self._decode_peers:
                    reject(self, f"Abort for room {room} from {src}",
                           "not a decode rank of this room" if claimants else "not a registered decode rank")
                else:  # before any TransferInfo: it stands for that rank's TransferInfo only
                    self._early_aborts.setdefault(room, {})[src] = msg.reason
                    self._early_time.setdefault(room, time.monotonic())
                    while len(self._early_aborts) > _FINISHED_CAP:  # bounded whatever a peer sends
                        oldest = next(iter(self._early_aborts))
                        del self._early_aborts[oldest]
                        self._early_time.pop(oldest, None)
                    logger.info("room %d: Abort from decode %s before its TransferInfo, recorded", room, src)
            self._send_ack(src, room)  # nothing of this room writes into src's memory

    def _remember(self, room: int, reason: str | None) -> None:
        self._finished[room] = reason
        while len(self._finished) > _FINISHED_CAP:
            self._finished.popitem(last=False)

    def _add_sender(self, sender: KVSender) -> None:
        """Under the lock: a new room's sender; one whose room already failed fails at once."""
        self._senders[sender.room] = sender
        reason = self._finished.pop(sender.room, None)
        if reason is not None:
            sender._status, sender._reason = KVPoll.Failed, reason
            del self._senders[sender.room]
            self._remember(sender.room, reason)
            logger.info("room %d: sender created for a room already failed: %s", sender.room, reason)

    def _end_room(self, room: int, reason: str | None) -> dict[int, TransferInfo]:
        """Under the lock: the room's sender ended (reason None: Success); returns the decode ranks'
        infos that were still waiting for it."""
        self._senders.pop(room, None)
        self._remember(room, reason)
        if reason is None:
            return {}
        self._info_time.pop(room, None)
        return dict(self._infos.pop(room, {}))

    def _expected_decode_ranks(self, decode_tp: int) -> list[int]:
        a = self.args
        lo = a.engine_rank * a.kv_head_num
        return ranks_overlapping(lo, lo + a.kv_head_num, a.total_kv_heads, decode_tp)

    def _check_ready(self, room: int) -> None:
        """Under the lock: if the sender has init() and every overlapping decode rank's info, start."""
        sender = self._senders.get(room)
        infos = self._infos.get(room)
        if sender is None or not infos or sender._targets is not None or sender._status in TERMINAL \
                or sender._num_pages is None:
            return
        decode_tp = next(iter(infos.values())).tp_size
        if any(i.tp_size != decode_tp for i in infos.values()):
            sender._fail("decode ranks disagree on their tp size", notify=infos)
            return
        if self.args.total_kv_heads % decode_tp:
            sender._fail(f"{self.args.total_kv_heads} kv heads cannot be split over decode tp {decode_tp}",
                         notify=infos)
            return
        expected = self._expected_decode_ranks(decode_tp)
        if any(r not in infos for r in expected):
            return
        targets = {r: infos[r] for r in expected}
        if any(not p.ready for p in (self._decode_peers.get(i.src) for i in targets.values()) if p is not None):
            return  # a decode rank's registration is still being added to the engine
        for r, info in targets.items():
            peer = self._decode_peers.get(info.src)
            problem = None
            if peer is None:
                problem = f"decode rank tp {r} is not registered"
            elif peer.error:
                problem = peer.error
            elif len(info.dst_page_indices) != sender._num_pages:
                problem = (f"page count mismatch: prefill sends {sender._num_pages} pages, decode tp {r} allocated "
                           f"{len(info.dst_page_indices)}")
            if problem:
                sender._fail(problem, notify=targets)
                return
        self._infos.pop(room, None)
        self._info_time.pop(room, None)
        sender._start(targets)

    def _tick_timeouts(self, now: float) -> None:
        timeout = self.settings.bootstrap_timeout
        for sender in list(self._senders.values()):
            if sender._status == KVPoll.Bootstrapping and now - sender._created > timeout:
                sender._fail(f"no TransferInfo from the decode side within {timeout:g}s (PDSERVE_BOOTSTRAP_TIMEOUT)")
        for room in [r for r, t in self._info_time.items() if r not in self._senders and now - t > timeout]:
            self._infos.pop(room, None)
            self._info_time.pop(room, None)
        for room in [r for r, t in self._early_time.items() if now - t > timeout]:
            self._early_aborts.pop(room, None)
            self._early_time.pop(room, None)

    # ------------------------------------------------------------------ chunk jobs
    def _submit(self, sender: KVSender, chunk: _Chunk) -> None:
        self._pool.submit(sender._run_chunk, chunk)

    def _chunk_regions(self, rank: int, info: TransferInfo, chunk: _Chunk, metadata_index: int):
        """(engine peer handle, batches) of one chunk for one decode rank: a batch is (source memory kind,
        destination memory kind, src, dst, lengths); kv pages, then the state slots, then the metadata row
        (the last chunk), one batch for each run of families that share their kinds (on the host: one)."""
        peer = self._decode_peers.get(info.src)
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
            families.append((plan.aux_memory, plan.aux_regions(metadata_index, info.metadata_index)))
        batches: list[tuple[str, str, list, list, list]] = []
        for (src_kind, dst_kind), (src, dst, lens) in families:
            if batches and batches[-1][:2] == (src_kind, dst_kind):
                batches[-1][2].extend(src)
                batches[-1][3].extend(dst)
                batches[-1][4].extend(lens)
            else:
                batches.append((src_kind, dst_kind, list(src), list(dst), list(lens)))
        return peer.handle, batches


class KVSender(KVRoom):
    """Prefill side of one request (room): its state, its queued chunks and its chunk jobs."""

    mgr: PrefillKVManager

    def __init__(self, mgr: PrefillKVManager, room: int) -> None:
        if not isinstance(mgr, PrefillKVManager):
            raise ValueError("KVSender needs a PrefillKVManager")
        super().__init__(mgr, room)
        self.bytes_sent = 0
        self._num_pages: int | None = None
        self._metadata_index = -1
        self._targets: dict[int, TransferInfo] | None = None  # decode tp rank -> its info, once ready
        self._queued: list[_Chunk] = []  # chunks sent before the sender was ready
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
            if self._next_offset + pages.size > self._num_pages:
                self._fail(f"more pages sent ({self._next_offset + pages.size}) than declared ({self._num_pages})")
                return
            chunk = _Chunk(self._next_offset, pages, states, last, ready)
            self._next_offset += pages.size
            if last:
                self._last_enqueued = True
                if self._next_offset != self._num_pages:
                    self._fail(f"last chunk ends at {self._next_offset} pages, init() declared {self._num_pages}")
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
            self._fail(f"injected failure (DISAGGREGATION_TEST_FAILURE_PROB={self.mgr.settings.failure_prob})")
            return
        self._status = KVPoll.Transferring if self._last_enqueued else KVPoll.WaitingForInput
        logger.info("room %d: ready to send to decode tp ranks %s", self.room, sorted(targets))
        queued, self._queued = self._queued, []
        for chunk in queued:
            self._submit(chunk)

    def _submit(self, chunk: _Chunk) -> None:
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
    def _run_chunk(self, chunk: _Chunk) -> None:
        mgr = self.mgr
        info, handle = None, None
        try:
            if self._status in TERMINAL:
                return
            if chunk.ready is not None:
                chunk.ready.synchronize()  # the device has written the chunk's pages (a GPU node's event)
            for rank, info in self._targets.items():
                handle, batches = mgr._chunk_regions(rank, info, chunk, self._metadata_index)
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
