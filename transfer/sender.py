"""Prefill side of the transfer protocol: `PrefillKVManager`, one per prefill rank.

The prefill rank pushes each request's KV pages (and, for a hybrid model, its state slots, and its
metadata row) into the decode ranks' memory. Its parts:

* the decode ranks registered with it (`transfer/decode_peers.py`, a base of the manager);
* one `KVSender` per request (room) with its chunks and the worker-thread jobs that write them
  (`transfer/kv_sender.py`);
* this module: the rooms as the manager sees them, from the first `TransferInfo` to their outcome.

Rooms. After registering, a decode rank sends a `TransferInfo` per room: where the room's pages,
state slots and metadata row land in its memory. A sender waits for the TransferInfo of every
decode rank whose kv heads overlap this rank's (parallel layouts: each info also says whether that
decode rank expects this rank to write its metadata row; the lowest overlapping tp rank of the last
pp stage does). Infos may come before their `KVSender` exists; they wait in `_infos`. Once the sender
has `init()`, every overlapping rank's info and every such rank is registered and checked
(`_check_ready`), the sender starts.

Peer values. Nothing a peer sends is used unchecked (`transfer/peer_checks.py`): a TransferInfo must
come from a registered rank, with its registered TP place, destination pages within 1 .. its pool's
pages - 1 without duplicates, a metadata row and state slots it has. A bad TransferInfo fails its
room (Status with the reason to the sender) unless another rank already holds that room's place,
then it is only dropped; both are counted (`rejected_peer_values`).

Aborts. An `Abort` counts only from a decode rank whose TransferInfo the room holds; one that comes
before any TransferInfo of the room is recorded for that rank alone (its TransferInfo, if it comes,
fails the room); any other is dropped and counted. Every Abort is answered with an `AbortAck` as
soon as no chunk job of the room can write into that decode rank's memory any more: at once when
the room never started or has no job left, else when its last job is done (the sender's drain).
Until then the decode keeps the room's pages out of use.

Outcomes. The manager remembers how recent rooms ended (`_finished`), so a TransferInfo, an Abort or
a `KVSender` that arrives after its room ended still gets the room's outcome. A room without all its
TransferInfos within `bootstrap_timeout` fails (`_tick_timeouts`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from transfer.base import KVArgs, KVPoll, TransferSettings
from transfer.bootstrap import BootstrapError
from transfer.control import Abort, AbortAck, Message, RegisterPeer, Status, TransferInfo
from transfer.decode_peers import DecodePeerRegistry
from transfer.engine import TransferEngine
from transfer.kv_sender import Chunk, KVSender
from transfer.manager import TERMINAL, KVManager
from transfer.peer_checks import check_info, check_registration, reject
from transfer.plan import head_range, heads_per_rank, ranks_overlapping

logger = logging.getLogger(__name__)

_FINISHED_CAP = 20000


class PrefillKVManager(DecodePeerRegistry, KVManager):
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
        self._pool = ThreadPoolExecutor(max_workers=self.settings.num_workers,
                                        thread_name_prefix="kv-prefill")  # the chunk jobs
        self._init_peers()
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
        self._close_peers()

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
                    sender._fail(f"{type(msg).__name__} from {msg.src} could not be handled: "
                                 f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ peers in use (under the lock)
    def _live_peers(self) -> dict[str, list[KVSender]]:
        live: dict[str, list[KVSender]] = {}
        for sender in self._senders.values():
            if sender._targets:
                for info in sender._targets.values():
                    live.setdefault(info.src, []).append(sender)
        return live

    def _has_rooms_with(self, addr: str) -> bool:
        """A started room sends to `addr`, or a room's TransferInfo from it waits."""
        return addr in self._live_peers() or any(i.src == addr for infos in self._infos.values()
                                                  for i in infos.values())

    def _idle_registered(self, live: dict[str, list]) -> set[str]:
        waiting = {i.src for infos in self._infos.values() for i in infos.values()}
        return {a for a in self._decode_peers if a not in live and a not in waiting}

    def _on_peer_dead(self, addr: str, rooms: list[KVSender], reason: str) -> None:
        for sender in rooms:
            sender._fail(reason)
        self._drop_decode_peer(addr)

    def _start_rooms_waiting_on(self, addr: str) -> None:
        """The registration of `addr` is complete: the rooms whose TransferInfo from it waited may start."""
        for room, infos in list(self._infos.items()):
            if any(i.src == addr for i in infos.values()):
                try:
                    self._check_ready(room)
                except Exception as e:  # that room fails; the registration thread goes on
                    logger.exception("room %d: could not start after %s registered", room, addr)
                    self._fail_room(room, f"could not start: {type(e).__name__}: {e}", {})

    def _room_stats(self) -> dict[str, int]:
        return {"transfer_rooms_open": len(self._senders), "transfer_rooms_draining": len(self._draining),
                "transfer_rooms_pending_info": len(self._infos),
                "transfer_early_aborts": len(self._early_aborts),
                "transfer_peers_registered": len(self._decode_peers)}

    # ------------------------------------------------------------------ messages to decode ranks
    def _send_status(self, addr: str, room: int, reason: str | None, unregistered: bool = False) -> None:
        """Tell a decode rank how the room ended here (reason None: Success)."""
        self.control.send(addr, Status(src=self.address, room=room, ok=reason is None, reason=reason or "",
                                       tp_rank=self.args.engine_rank, pp_rank=self.args.pp_rank,
                                       unregistered=unregistered))

    def _send_ack(self, addr: str, room: int) -> None:
        """Tell a decode rank that no chunk job of `room` can write into its memory any more."""
        self.control.send(addr, AbortAck(src=self.address, room=room, tp_rank=self.args.engine_rank,
                                         pp_rank=self.args.pp_rank))

    # ------------------------------------------------------------------ messages from decode ranks
    def _on_info(self, info: TransferInfo) -> None:
        with self._lock:
            room = info.room
            what = f"TransferInfo for room {room} from {info.src}"
            if room in self._finished:
                reason = self._finished[room]
                if reason is not None:
                    self._send_status(info.src, room, reason)
                return
            peer = self._decode_peers.get(info.src)
            if peer is None:
                reason = ("decode rank is not registered with this prefill rank "
                          "(prefill restarted or peer evicted)")
                reject(self, what, reason)
                self._send_status(info.src, room, reason, unregistered=True)
                return
            held = self._infos.get(room, {}).get(info.tp_rank)
            sender = self._senders.get(room)
            if held is not None and held.src != info.src:
                reject(self, what, f"decode tp {info.tp_rank} of this room is {held.src}")
                return
            if sender is not None and sender._targets is not None:
                reject(self, what, "the room is already transferring")
                return
            reg_error = peer.error if peer.ready else check_registration(self.args, peer.reg)
            if reg_error:
                problem = f"decode rank's registration was rejected: {reg_error}"
            else:
                problem = check_info(peer.reg, info)
            if problem is None and info.src in self._early_aborts.get(room, {}):
                problem = f"aborted by the decode side: {self._early_aborts[room][info.src]}"
            if problem is not None:
                reject(self, what, problem)
                self._fail_room(room, problem, {info.tp_rank: info})
                return
            self._infos.setdefault(room, {})[info.tp_rank] = info
            self._info_time.setdefault(room, time.monotonic())
            logger.info("room %d: TransferInfo from decode tp %d (%d pages)", room, info.tp_rank,
                        len(info.dst_page_indices))
            self._check_ready(room)

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
                    self._record_early_abort(room, src, msg.reason)
            self._send_ack(src, room)  # nothing of this room writes into src's memory

    def _record_early_abort(self, room: int, src: str, reason: str) -> None:
        self._early_aborts.setdefault(room, {})[src] = reason
        self._early_time.setdefault(room, time.monotonic())
        while len(self._early_aborts) > _FINISHED_CAP:  # bounded whatever a peer sends
            oldest = next(iter(self._early_aborts))
            del self._early_aborts[oldest]
            self._early_time.pop(oldest, None)
        logger.info("room %d: Abort from decode %s before its TransferInfo, recorded", room, src)

    # ------------------------------------------------------------------ rooms (under the lock)
    def _add_sender(self, sender: KVSender) -> None:
        """A new room's sender; one whose room already failed fails at once."""
        self._senders[sender.room] = sender
        reason = self._finished.pop(sender.room, None)
        if reason is not None:
            sender._status, sender._reason = KVPoll.Failed, reason
            del self._senders[sender.room]
            self._remember(sender.room, reason)
            logger.info("room %d: sender created for a room already failed: %s", sender.room, reason)

    def _expected_decode_ranks(self, decode_tp: int) -> list[int]:
        a = self.args
        lo, hi = head_range(a.engine_rank, a.tp_size, a.total_kv_heads)
        return ranks_overlapping(lo, hi, a.total_kv_heads, decode_tp)

    def _check_ready(self, room: int) -> None:
        """If the sender has init() and every overlapping decode rank's info, start."""
        sender = self._senders.get(room)
        infos = self._infos.get(room)
        if sender is None or not infos or sender._targets is not None or sender._status in TERMINAL \
                or sender._num_pages is None:
            return
        decode_tp = next(iter(infos.values())).tp_size
        if any(i.tp_size != decode_tp for i in infos.values()):
            sender._fail("decode ranks disagree on their tp size", notify=infos)
            return
        if heads_per_rank(self.args.total_kv_heads, decode_tp) is None:
            sender._fail(f"{self.args.total_kv_heads} kv heads cannot be split over decode tp {decode_tp}",
                         notify=infos)
            return
        expected = self._expected_decode_ranks(decode_tp)
        if any(r not in infos for r in expected):
            return
        targets = {r: infos[r] for r in expected}
        peers = [self._decode_peers.get(i.src) for i in targets.values()]
        if any(p is not None and not p.ready for p in peers):
            return  # a decode rank's registration is still being added to the engine
        for r, info in targets.items():
            peer = self._decode_peers.get(info.src)
            problem = None
            if peer is None:
                problem = f"decode rank tp {r} is not registered"
            elif peer.error:
                problem = peer.error
            elif len(info.dst_page_indices) != sender._num_pages:
                problem = (f"page count mismatch: prefill sends {sender._num_pages} pages, decode tp {r} "
                           f"allocated {len(info.dst_page_indices)}")
            if problem:
                sender._fail(problem, notify=targets)
                return
        self._infos.pop(room, None)
        self._info_time.pop(room, None)
        sender._start(targets)

    def _fail_room(self, room: int, reason: str, notify: dict[int, TransferInfo]) -> None:
        """Fail a room that has not started, with or without its sender yet."""
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

    def _end_room(self, room: int, reason: str | None) -> dict[int, TransferInfo]:
        """The room's sender ended (reason None: Success); returns the decode ranks' infos that were
        still waiting for it."""
        self._senders.pop(room, None)
        self._remember(room, reason)
        if reason is None:
            return {}
        self._info_time.pop(room, None)
        return dict(self._infos.pop(room, {}))

    def _remember(self, room: int, reason: str | None) -> None:
        self._finished[room] = reason
        while len(self._finished) > _FINISHED_CAP:
            self._finished.popitem(last=False)

    def _tick_timeouts(self, now: float) -> None:
        timeout = self.settings.bootstrap_timeout
        for sender in list(self._senders.values()):
            if sender._status == KVPoll.Bootstrapping and now - sender._created > timeout:
                sender._fail(f"no TransferInfo from the decode side within {timeout:g}s "
                             "(PDSERVE_BOOTSTRAP_TIMEOUT)")
        for room in [r for r, t in self._info_time.items() if r not in self._senders and now - t > timeout]:
            self._infos.pop(room, None)
            self._info_time.pop(room, None)
        for room in [r for r, t in self._early_time.items() if now - t > timeout]:
            self._early_aborts.pop(room, None)
            self._early_time.pop(room, None)

    # ------------------------------------------------------------------ chunk jobs
    def _submit(self, sender: KVSender, chunk: Chunk) -> None:
        self._pool.submit(sender._run_chunk, chunk)
