"""Decode side of the transfer protocol: `DecodeKVManager` and a `KVReceiver` per request (room).

Resolving. A receiver names the prefill node's bootstrap server ("host:port", from the router). The
manager's resolver thread asks it for the node's layout, checks it against this rank's (page size,
model, KV layout, compatibility fingerprint when the layout names one, kv head count; hybrid state
and prefill pp > 1 do not mix) and looks up the prefill ranks this rank reads from: every tp rank
whose kv heads overlap this rank's, in every pp stage, of the prefill DP group that holds the room
(room mod the layout's dp_size, unless the receiver was given one). The one that writes the metadata
row is the lowest of them in the last pp stage. Lookups are grouped per bootstrap server, then per
dp group, and cached by the bootstrap client. A server that refuses connections for a whole
heartbeat window fails its rooms at once (the prefill node is gone); one that answers without the
ranks yet (404) is retried until `bootstrap_timeout`. Its answers are peer values like any other: an
address that is not host:port, an answer that is not JSON or not of the layout's / rank's shape and
types (`transfer/peer_checks.py`) fails the rooms of that address with the reason; nothing a
bootstrap server answers ends the resolver thread.

Sending the info. Once resolved and `init()`-ed, the receiver registers this rank with each
target prefill rank (once per manager: `RegisterPeer`, built by `peer_registration`) and sends it
the room's `TransferInfo` (destination pages, metadata slot, state slots, whether it writes the
metadata row). It then waits for a `Status` from every target; on the last Success it checks that
the received metadata row holds its own room.

States. Bootstrapping (resolving prefill ranks) -> WaitingForInput (resolved, `init()` not called)
-> Transferring (TransferInfo sent) -> Success. Failed with a reason on: a prefill rank's failure
Status, prefill peer silent past the heartbeat window, bootstrap or waiting timeout, abort, room
mismatch, layout mismatch. A `Status` counts only from a prefill rank this room's TransferInfo went
to (same address, tp and pp rank); any other is dropped and counted (`rejected_peer_values`).

Restarted prefill nodes. When a prefill rank is declared dead, every cached bootstrap answer naming
its control address is dropped, and for max(5 s, two heartbeat windows) an answer that still names
it is asked again instead of used (a crashed node's bootstrap server can outlive its front end for a
moment and hand out the dead rank; a restarted rank registers a new address). A rank declared dead
while alive (the AbortAck timeout) is resolved again after that grace period.

Quarantine. A failing receiver tells its prefill ranks (`Abort`) to stop writing. If it had sent its
TransferInfo, a chunk job may still be inside the engine's `write` to its pages, so the room drains:
`drain_poll()` stays Transferring until every prefill rank it sent the info to has answered
`AbortAck` (no job of the room can write any more) or has been declared dead (heartbeats, which go
on for draining rooms). The role keeps the room's pages, metadata slot and row (its state slot)
out of use until then. A rank that stays alive without acking for `abort_ack_timeout` is declared
dead (logged once; its socket and registration dropped, its other rooms failed), which ends the
drain: the wait is bounded, never cut short. A room that never sent its TransferInfo, or reached
Success, does not drain.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from transfer.base import KVArgs, KVPoll, TransferSettings
from transfer.control import Abort, AbortAck, Message, Status, TransferInfo, peer_registration
from transfer.engine import TransferEngine
from transfer.manager import TERMINAL, KVManager, KVRoom
from transfer.peer_checks import check_bootstrap_addr, check_layout, check_rank, fingerprint_problem, reject
from transfer.plan import head_range, heads_per_rank, ranks_overlapping

logger = logging.getLogger(__name__)

_DEAD_PEERS_CAP = 1024


@dataclass
class _Target:
    tp_rank: int
    pp_rank: int
    addr: str
    writes_metadata: bool


class DecodeKVManager(KVManager):
    """One per decode rank (pipeline parallel size 1). `create_receiver(bootstrap_addr, room)`
    makes a room's `KVReceiver`."""

    side = "decode"
    peer_side = "prefill"

    def __init__(self, args: KVArgs, backend: str | TransferEngine = "mooncake",
                 settings: TransferSettings | None = None, host: str = "127.0.0.1", **overrides) -> None:
        if args.pp_size != 1:
            raise ValueError("decode ranks must run pipeline parallel size 1")
        super().__init__(args, backend, settings, host, **overrides)

    def create_receiver(self, bootstrap_addr: str, room: int,
                        prefill_dp_rank: int | None = None) -> KVReceiver:
        return KVReceiver(self, bootstrap_addr, room, prefill_dp_rank)

    # ------------------------------------------------------------------ side hooks
    def _init_side(self) -> None:
        self._receivers: dict[int, KVReceiver] = {}
        self._registered_with: set[str] = set()  # prefill ranks that have our RegisterPeer
        self._draining: dict[int, KVReceiver] = {}  # failed rooms waiting for their prefill ranks' AbortAck
        # prefill control address -> when declared dead (oldest first)
        self._dead_peers: dict[str, float] = {}
        self._dead_grace = max(5.0, 2 * self.settings.heartbeat_window)
        self._resolve_wake = threading.Event()
        self.rejected_peer_values = 0

    def _start_side(self) -> None:
        # built once: the buffers and the engine's description never change, and a transfer engine's
        # describe() is a call into the transfer library that a room's TransferInfo, sent under the
        # manager's lock, need not make
        self._registration = peer_registration(self.args, self.address, self.engine.describe())
        self._resolver = threading.Thread(target=self._resolve_loop, name="kv-decode-resolver", daemon=True)
        self._resolver.start()

    def _close_side(self) -> None:
        self._resolve_wake.set()
        self._resolver.join(timeout=5)

    def _dispatch(self, msg: Message) -> None:
        if not isinstance(msg, (Status, AbortAck)):
            return
        with self._lock:
            try:
                if isinstance(msg, Status):
                    self._on_status(msg)
                else:
                    self._on_ack(msg)
            except Exception as e:  # a value no check foresaw: fail that room, keep serving
                logger.exception("room %s: %s from %s could not be handled", msg.room,
                                 type(msg).__name__, msg.src)
                receiver = self._receivers.get(msg.room)
                if receiver is not None:
                    receiver._fail(f"{type(msg).__name__} from {msg.src} could not be handled: "
                                   f"{type(e).__name__}: {e}")

    def _on_status(self, msg: Status) -> None:
        """Under the lock: a Status counts only from a prefill rank the room's TransferInfo went to."""
        receiver = self._receivers.get(msg.room)
        if receiver is None:
            return  # the room already ended here (a late Status is normal)
        if receiver._sent_at is None or not receiver._is_target(msg.src, msg.tp_rank, msg.pp_rank):
            reject(self, f"Status for room {msg.room} from {msg.src} (tp {msg.tp_rank} pp {msg.pp_rank})",
                   "not a prefill rank this room's TransferInfo went to")
            return
        receiver._on_status(msg)

    def _on_ack(self, msg: AbortAck) -> None:
        """Under the lock: a prefill rank's chunk jobs of a draining room are over."""
        receiver = self._draining.get(msg.room)
        if receiver is None:
            return  # a room that needed no drain (its TransferInfo was never sent) or drained already
        if not receiver._is_target(msg.src, msg.tp_rank, msg.pp_rank):
            reject(self, f"AbortAck for room {msg.room} from {msg.src} (tp {msg.tp_rank} pp {msg.pp_rank})",
                   "not a prefill rank this room's TransferInfo went to")
            return
        receiver._drained_by(msg.src, f"AbortAck from {msg.src}")

    def _is_known_peer(self, addr: str) -> bool:
        return addr in self._registered_with

    def _idle_registered(self, live: dict[str, list]) -> set[str]:
        # a resolved room that has not sent its TransferInfo yet will use its registration soon
        pending = {t.addr for r in self._receivers.values() for t in r._targets or ()}
        return {a for a in self._registered_with if a not in live and a not in pending}

    def _expire_peer(self, addr: str) -> None:
        self._registered_with.discard(addr)

    def _room_stats(self) -> dict[str, int]:
        return {"transfer_rooms_open": len(self._receivers), "transfer_rooms_draining": len(self._draining),
                "transfer_peers_registered": len(self._registered_with)}

    def _live_peers(self) -> dict[str, list[KVReceiver]]:
        """Prefill ranks of transferring rooms, and those a draining room waits for (so a dead one ends
        it)."""
        live: dict[str, list[KVReceiver]] = {}
        for receiver in self._receivers.values():
            if receiver._targets and receiver._status == KVPoll.Transferring:
                for t in receiver._targets:
                    live.setdefault(t.addr, []).append(receiver)
        for receiver in self._draining.values():
            for addr in receiver._drain:
                live.setdefault(addr, [])
        return live

    def _tick_timeouts(self, now: float) -> None:
        s = self.settings
        for receiver in list(self._receivers.values()):
            receiver._check_deadlines(now, s.bootstrap_timeout, s.waiting_timeout)
        late: dict[str, list[int]] = {}
        for receiver in self._draining.values():
            if now - receiver._drain_since > s.abort_ack_timeout:
                for addr in receiver._drain:
                    late.setdefault(addr, []).append(receiver.room)
        for addr, rooms in late.items():
            # alive (it answers pings) yet silent about these rooms: it may still write into their pages
            reason = (f"prefill peer {addr} sent no AbortAck for room(s) {sorted(rooms)} within "
                      f"{s.abort_ack_timeout:g}s (PDSERVE_ABORT_ACK_TIMEOUT): declared dead")
            logger.error("%s; their pages were kept out of use until now", reason)
            live = [r for r in self._receivers.values() if r._status == KVPoll.Transferring
                    and any(t.addr == addr for t in r._targets or [])]
            self._on_peer_dead(addr, live, reason)
            self._forget_peer(addr)

    def _on_peer_dead(self, addr: str, rooms: list[KVReceiver], reason: str) -> None:
        for receiver in rooms:
            receiver._fail(reason)
        for receiver in list(self._draining.values()):
            if addr in receiver._drain:
                receiver._drained_by(addr, "its prefill rank was declared dead")
        self._registered_with.discard(addr)
        for receiver in self._receivers.values():
            if receiver._targets and any(t.addr == addr for t in receiver._targets):
                self.bootstrap.invalidate(receiver.bootstrap_addr)
        # a crashed prefill node's bootstrap server may answer with the dead rank for a moment after
        # this (its front end died first), and any room resolved from that answer would send its
        # TransferInfo into the void until the heartbeats fail it: cached answers naming the rank are
        # dropped and, for a grace period, fresh ones are not used (a rank declared dead while alive,
        # e.g. after the AbortAck timeout, is resolved again after it)
        self.bootstrap.invalidate_rank(addr)
        self._dead_peers[addr] = time.monotonic()
        while len(self._dead_peers) > _DEAD_PEERS_CAP:
            self._dead_peers.pop(next(iter(self._dead_peers)))

    # ------------------------------------------------------------------ rooms
    def _add_receiver(self, receiver: KVReceiver) -> None:
        with self._lock:
            self._receivers[receiver.room] = receiver
        self._resolve_wake.set()

    def _ensure_registered(self, addr: str) -> bool:
        """Under the lock: send our `RegisterPeer` to a prefill rank once; False if it cannot be reached."""
        if addr in self._registered_with:
            return True
        if not self.control.send(addr, self._registration):
            return False
        self._registered_with.add(addr)
        return True

    # ------------------------------------------------------------------ resolver thread
    def _resolve_loop(self) -> None:
        while not self._stop.is_set():
            self._resolve_wake.wait(timeout=0.1)
            self._resolve_wake.clear()
            try:
                busy = self._resolve_pending()
            except Exception:  # never the thread: the next pass tries again
                logger.exception("kv decode resolver: a pass failed")
                busy = True
            if busy:
                time.sleep(0.05)

    def _resolve_pending(self) -> bool:
        """One pass over the rooms still resolving, grouped per bootstrap server, then per prefill dp
        group."""
        with self._lock:
            todo = [r for r in self._receivers.values()
                    if r._status == KVPoll.Bootstrapping and r._targets is None]
        servers: dict[str, list[KVReceiver]] = {}
        for receiver in todo:
            servers.setdefault(receiver.bootstrap_addr, []).append(receiver)
        for addr, rooms in servers.items():
            try:
                layout, problem, fatal = self._layout(addr)
                if layout is None:
                    outcomes = [((None, problem, fatal), rooms)]
                else:
                    by_dp: dict[int, list[KVReceiver]] = {}
                    for receiver in rooms:
                        dp = receiver._dp_rank if receiver._dp_rank is not None \
                            else receiver.room % layout["dp_size"]
                        by_dp.setdefault(dp, []).append(receiver)
                    outcomes = [(self._targets(addr, layout, dp), group) for dp, group in by_dp.items()]
            except Exception as e:  # whatever the server answered, only its rooms fail
                logger.warning("bootstrap server %s: lookup failed: %s: %s", addr, type(e).__name__, e)
                outcomes = [((None, f"bootstrap server {addr} lookup failed: "
                                    f"{type(e).__name__}: {e}", True), rooms)]
            for (targets, problem, fatal), group in outcomes:
                if fatal:
                    self.bootstrap.invalidate(addr)
                with self._lock:
                    for receiver in group:
                        if receiver._status in TERMINAL:
                            continue
                        if fatal:
                            receiver._fail(problem)
                        elif targets is None:
                            receiver._problem = problem
                        else:
                            receiver._resolved(targets)
        return bool(todo)

    def _layout(self, addr: str) -> tuple[dict | None, str, bool]:
        """(layout, problem, fatal): the prefill node's layout at `addr` when it matches this rank's."""
        a = self.args
        bad = check_bootstrap_addr(addr)
        if bad:
            return None, bad, True
        try:
            layout = self.bootstrap.layout(addr)
        except ValueError as e:  # not JSON (or not even HTTP)
            return None, f"bootstrap server {addr} answered something that is not a JSON layout: {e}", True
        if layout is None:
            down = self.bootstrap.unreachable_for(addr)
            if down > self.settings.heartbeat_window:
                # a prefill node the router sent us to was serving moments ago: refused connections
                # for a whole heartbeat window mean it is gone, not starting
                return None, f"bootstrap server {addr} unreachable for {down:.1f}s: prefill node down", True
            return None, f"bootstrap server {addr} has no registered prefill rank or is unreachable", False
        bad = check_layout(layout)
        if bad:
            return None, f"bootstrap server {addr}: {bad}", True
        if layout["page_size"] != a.page_size:
            return None, f"page size mismatch: prefill {layout['page_size']}, decode {a.page_size}", True
        if a.model and layout["model"] and layout["model"] != a.model:
            return None, f"model mismatch: prefill {layout['model']!r}, decode {a.model!r}", True
        if layout.get("kv_layout", a.kv_layout) != a.kv_layout:
            return None, f"kv layout mismatch: prefill {layout['kv_layout']!r}, decode {a.kv_layout!r}", True
        problem = fingerprint_problem(layout.get("fingerprint") or "", a.fingerprint)
        if problem:
            return None, problem, True
        total, ptp = layout["kv_heads_total"], layout["tp_size"]
        if total != a.total_kv_heads:
            return None, f"kv head count mismatch: prefill {total}, decode {a.total_kv_heads}", True
        if heads_per_rank(total, ptp) is None:
            return None, f"{total} kv heads cannot be split over prefill tp {ptp}", True
        return layout, "", False

    def _targets(self, addr: str, layout: dict, dp: int) -> tuple[list[_Target] | None, str, bool]:
        """(targets, problem, fatal): the ranks of prefill dp group `dp` this decode rank reads from."""
        a = self.args
        if not 0 <= dp < layout["dp_size"]:  # a rank the request named
            return None, f"bootstrap server {addr}: prefill dp rank {dp} requested, the layout has dp_size " \
                         f"{layout['dp_size']}", True
        total, ptp = layout["kv_heads_total"], layout["tp_size"]
        lo, hi = head_range(a.engine_rank, a.tp_size, a.total_kv_heads)
        ranks = ranks_overlapping(lo, hi, total, ptp)
        last_pp = layout["pp_size"] - 1
        targets = []
        for pp in range(layout["pp_size"]):
            for tp in ranks:
                try:
                    info = self.bootstrap.rank(addr, tp, dp, pp)
                except ValueError as e:
                    return None, (f"bootstrap server {addr} answered something that is not JSON for "
                                  f"rank tp {tp}: {e}"), True
                if info is None:
                    return None, f"prefill rank tp {tp} dp {dp} pp {pp} not registered at {addr} yet", False
                bad = check_rank(info)
                if bad:
                    return None, f"bootstrap server {addr}, prefill rank tp {tp} dp {dp} pp {pp}: {bad}", True
                control = f"tcp://{info['rank_ip']}:{info['rank_port']}"
                if time.monotonic() - self._dead_peers.get(control, -1e9) < self._dead_grace:
                    # the answer of a node that is going down, or cached from before its restart: ask
                    # again until the restarted rank registers its new address
                    self.bootstrap.invalidate(addr)
                    return None, (f"prefill rank tp {tp} dp {dp} pp {pp} at {addr} is still registered at "
                                  f"{control}, which was declared dead"), False
                targets.append(_Target(tp, pp, control, writes_metadata=(pp == last_pp and tp == ranks[0])))
        return targets, "", False


class KVReceiver(KVRoom):
    """Decode side of one request (room); `bootstrap_addr` is the prefill node's "host:port"."""

    mgr: DecodeKVManager

    def __init__(self, mgr: DecodeKVManager, bootstrap_addr: str, room: int,
                 prefill_dp_rank: int | None = None) -> None:
        if not isinstance(mgr, DecodeKVManager):
            raise ValueError("KVReceiver needs a DecodeKVManager")
        super().__init__(mgr, room)
        self.bootstrap_addr = bootstrap_addr
        self._dp_rank = prefill_dp_rank  # None: room mod the prefill node's dp_size
        self._problem = "bootstrap server not answering yet"  # why it is not resolved yet
        self._targets: list[_Target] | None = None
        self._params: tuple[list[int], int, list[int]] | None = None  # pages, metadata slot, state slots
        self._sent_at: float | None = None
        self._pending: set[tuple[int, int]] = set()  # (tp, pp) of the prefill ranks yet to report Success
        self._info_sent_to: set[str] = set()  # prefill ranks that have this room's TransferInfo
        # prefill ranks that forgot us during this room (registered again)
        self._reregistered: set[str] = set()
        self._drain: set[str] = set()  # after a failure: prefill ranks that may still write (no AbortAck yet)
        self._drain_since = 0.0
        # the role's check of the received metadata row (slot -> problem or None), run before Success
        self.check_metadata: Callable[[int], str | None] | None = None
        self.traceparent: str | None = None  # the request's trace context, sent in the TransferInfo
        mgr._add_receiver(self)

    def init(self, dst_page_indices, metadata_index: int, state_indices=None) -> None:
        """Declare where the pages, metadata row and state slots must land; tells the prefill ranks."""
        pages = [int(p) for p in np.asarray(dst_page_indices, dtype=np.int64).reshape(-1)]
        states = [] if state_indices is None else [int(s) for s in np.asarray(state_indices).reshape(-1)]
        with self.mgr._lock:
            if self._status in TERMINAL:
                return
            if self._params is not None:
                raise RuntimeError(f"room {self.room}: init() called twice")
            self._params = (pages, int(metadata_index), states)
            if self._targets is not None:
                self._send_infos()

    # ------------------------------------------------------------------ under the manager's lock
    def _resolved(self, targets: list[_Target]) -> None:
        self._targets = targets
        self._pending = {(t.tp_rank, t.pp_rank) for t in targets}
        self._status = KVPoll.WaitingForInput
        logger.info("room %d: resolved prefill ranks %s", self.room,
                    [(t.tp_rank, t.pp_rank) for t in targets])
        if self._params is not None:
            self._send_infos()

    def _send_infos(self) -> None:
        """Register with each target prefill rank (once per manager) and send it the room's info."""
        for t in self._targets:
            if not self._send_info(t):
                return
        self._sent_at = time.monotonic()
        self._status = KVPoll.Transferring
        logger.info("room %d: TransferInfo sent to %d prefill rank(s), %d pages",
                    self.room, len(self._targets), len(self._params[0]))

    def _send_info(self, t: _Target) -> bool:
        mgr, a = self.mgr, self.mgr.args
        pages, meta, states = self._params
        info = TransferInfo(src=mgr.address, room=self.room, tp_rank=a.engine_rank, tp_size=a.tp_size,
                            dst_page_indices=pages, metadata_index=meta, state_indices=states,
                            expects_metadata=t.writes_metadata, traceparent=self.traceparent)
        if not (mgr._ensure_registered(t.addr) and mgr.control.send(t.addr, info)):
            self._fail(f"cannot reach prefill rank tp {t.tp_rank} at {t.addr}")
            return False
        self._info_sent_to.add(t.addr)
        return True

    def _on_status(self, msg: Status) -> None:
        if self._status in TERMINAL:
            return
        if not msg.ok and msg.unregistered and msg.src not in self._reregistered:
            self._register_again(msg)
            return
        if not msg.ok:
            # tell the other prefill ranks of this room to stop writing into pages about to be freed
            self._fail(f"prefill rank tp {msg.tp_rank} pp {msg.pp_rank}: {msg.reason}")
            return
        self._pending.discard((msg.tp_rank, msg.pp_rank))
        if self._pending or self._params is None:
            return
        problem = self._check_room() or self._check_metadata()
        if problem:
            reject(self.mgr, f"metadata row of room {self.room}", problem)
            self._fail(problem)
            return
        self._status = KVPoll.Success
        self.mgr._receivers.pop(self.room, None)
        logger.info("room %d: receiver Success", self.room)

    def _register_again(self, msg: Status) -> None:
        """The prefill rank forgot this manager (restarted, or evicted an idle registration) and kept
        nothing of the room's TransferInfo: register again and resend it, once per rank and room."""
        self._reregistered.add(msg.src)
        self.mgr._registered_with.discard(msg.src)
        logger.info("room %d: prefill rank tp %d at %s does not know this decode rank: registering again",
                    self.room, msg.tp_rank, msg.src)
        for t in self._targets:
            if t.addr == msg.src and not self._send_info(t):
                return

    def _check_room(self) -> str | None:
        """The received metadata row must hold this room (a row meant for another room means crossed
        wires)."""
        mgr, a = self.mgr, self.mgr.args
        if not mgr.moves_bytes or a.aux_room_index < 0:
            return None
        meta = self._params[1]
        got = ctypes.c_int64.from_address(a.aux_data_ptrs[a.aux_room_index]
                                          + meta * a.aux_item_lens[a.aux_room_index]).value
        if got != self.room:
            return f"metadata room mismatch: slot {meta} holds room {got}, expected {self.room}"
        return None

    def _check_metadata(self) -> str | None:
        """The role's check of the received row (first token within the vocabulary, ...)."""
        if self.check_metadata is None or not self.mgr.moves_bytes:
            return None
        try:
            problem = self.check_metadata(self._params[1])
        except Exception as e:
            problem = f"it could not be checked: {type(e).__name__}: {e}"
        return f"bad metadata row from the prefill side: {problem}" if problem else None

    def _check_deadlines(self, now: float, bootstrap_timeout: float, waiting_timeout: float) -> None:
        if self._status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and self._targets is None \
                and now - self._created > bootstrap_timeout:
            self._fail(f"bootstrap timed out after {bootstrap_timeout:g}s (PDSERVE_BOOTSTRAP_TIMEOUT): "
                       f"{self._problem}")
        elif self._status == KVPoll.Transferring and now - self._sent_at > waiting_timeout:
            self._fail(f"no Success within {waiting_timeout:g}s (PDSERVE_WAITING_TIMEOUT)")

    def _is_target(self, addr: str, tp_rank: int, pp_rank: int) -> bool:
        return any(t.addr == addr and t.tp_rank == tp_rank and t.pp_rank == pp_rank
                   for t in self._targets or [])

    def _fail(self, reason: str) -> None:
        """Fail the room and tell its prefill ranks (those already done ignore it); the ranks that had
        its TransferInfo and did not report Success may still write: the room drains until they ack."""
        if self._status in TERMINAL:
            return
        self._status, self._reason = KVPoll.Failed, reason
        mgr = self.mgr
        mgr._receivers.pop(self.room, None)
        if self._targets:
            for t in self._targets:
                mgr.control.send(t.addr, Abort(src=mgr.address, room=self.room, reason=reason))
            self._drain = {t.addr for t in self._targets
                           if t.addr in self._info_sent_to and (t.tp_rank, t.pp_rank) in self._pending}
        logger.warning("room %d: receiver Failed: %s", self.room, reason)
        if self._drain:
            self._drain_since = time.monotonic()
            mgr._draining[self.room] = self
            logger.info("room %d: draining: its pages stay out of use until %s acknowledge "
                        "the abort", self.room, sorted(self._drain))

    def _drained_by(self, addr: str, why: str) -> None:
        """Under the lock: prefill rank `addr` can no longer write into this room's pages."""
        self._drain.discard(addr)
        if not self._drain and self.mgr._draining.pop(self.room, None) is not None:
            logger.info("room %d: drained (%s): its pages may be reused", self.room, why)

    def drain_poll(self) -> KVPoll:
        """Success once no prefill rank can write into this room's pages any more (at once for a room
        that never sent its TransferInfo, or reached Success); Transferring while it drains."""
        with self.mgr._lock:
            return KVPoll.Transferring if self._drain else KVPoll.Success
