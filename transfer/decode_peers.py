"""The decode ranks registered with a prefill rank: `DecodePeerRegistry`, a part of `PrefillKVManager`.

Registration. A decode rank registers once (`RegisterPeer`: its engine description, buffer
addresses, item sizes and strides, TP place). It is recorded at once as not ready, so that its
TransferInfos can wait for it; the rest runs on a registration thread of its own, because the
control plane's thread must keep answering heartbeats: the layout is checked against this rank's
(`transfer/peer_checks.py`), the peer is added to the engine, and the pair's region plan is built
(`transfer/plan.py`). A registration that fails any of it is kept with its error, so every room
that names that peer fails with it. Once ready, the rooms waiting on the peer may start
(`_start_rooms_waiting_on`, the manager's).

Bounds. A decode rank with live or pending rooms may not change its registration (that would
redirect their writes). At most `max_decode_peers` registrations are kept, whatever unauthenticated
peers send: a full registry makes room by dropping a failed registration, never a working one.

Forgetting. A peer is dropped when it is declared dead, when it stays idle past
`peer_idle_timeout` (`_expire_peer`, from the base manager), or when a write to it failed (its
connection may be broken for good); its engine peer is removed on the registration thread, since
closing an endpoint may block. A dropped peer that comes back registers again from scratch.

The registry runs under the manager's lock and counts on the manager for `args`, `settings`,
`engine`, the registration counters, `_has_rooms_with(addr)` and `_start_rooms_waiting_on(addr)`.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from transfer.control import RegisterPeer
from transfer.peer_checks import check_registration, reject
from transfer.plan import PairPlan

logger = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    reg: RegisterPeer
    handle: str  # the engine's peer handle ("" until added)
    error: str | None  # why the registration was refused
    plan: PairPlan | None
    ready: bool = True  # False while the registration thread checks it and adds it to the engine


class DecodePeerRegistry:
    def _init_peers(self) -> None:
        self._register_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefill-register")
        self._decode_peers: dict[str, DecodePeer] = {}

    def _close_peers(self) -> None:
        self._register_pool.shutdown(wait=False, cancel_futures=True)

    def _on_register(self, reg: RegisterPeer) -> None:
        """Record the peer at once (so its TransferInfo can queue) and add it to the engine off the
        receiver thread, which must keep answering heartbeats. A registration that differs from the
        one a peer with live or pending rooms made is refused: it would redirect their writes."""
        with self._lock:
            old = self._decode_peers.get(reg.src)
            if old is not None and old.reg != reg and self._has_rooms_with(reg.src):
                self.registrations_refused += 1
                logger.warning("decode peer %s: refused a RegisterPeer that differs from its registration "
                               "while it has live rooms", reg.src)
                return
            if old is None and not self._make_room_for_peer(reg.src):
                return
            self._decode_peers.pop(reg.src, None)  # re-inserted: the newest registration is evicted last
            self._decode_peers[reg.src] = DecodePeer(reg, "", None, None, ready=False)
        self._register_pool.submit(self._complete_register, reg)

    def _complete_register(self, reg: RegisterPeer) -> None:
        """On the registration thread: check the registration, add the peer to the engine, plan the pair."""
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
            self._start_rooms_waiting_on(reg.src)

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
            logger.warning("decode peer %s: a write failed (%s); forgotten until it registers again",
                           addr, reason)
            self._drop_decode_peer(addr)

    def _remove_engine_peer(self, addr: str, handle) -> None:
        try:
            self.engine.remove_peer(handle)
        except Exception as e:
            logger.warning("engine could not remove decode peer %s: %s", addr, e)

    def _is_known_peer(self, addr: str) -> bool:
        return addr in self._decode_peers

    def _expire_peer(self, addr: str) -> None:
        self._drop_decode_peer(addr)
