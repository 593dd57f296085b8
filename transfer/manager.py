"""KVManager: what the prefill and the decode side's managers share, on top of any engine.

Roles. One manager per rank. A prefill rank's `PrefillKVManager` (`transfer/sender.py`) registers
its control address with its node's bootstrap server and pushes KV pages into decode ranks; a
decode rank's `DecodeKVManager` (`transfer/receiver.py`) looks the prefill ranks up through the
bootstrap server, tells them where each request's pages must land (`TransferInfo`) and waits for
their `Status`. Each request (room) is one `KVSender` / `KVReceiver`, which owns the room's state.

This base owns the engine (built from a backend name, or given) and the registration of the
rank's buffers (the union of their spans per memory kind, `registrations`: the page-first pool is one
registration; on a GPU the metadata rows are host memory registered apart from the device's), the control
plane (`transfer/control.py`) with its message dispatch, the bootstrap client, peer liveness and
the timer thread, and `close()`. One re-entrant lock per manager guards the manager's state and
that of its rooms; the control plane's receiver thread, the timer, the worker threads and the
caller's thread all take it.

Authentication. With a cluster secret in the settings the control plane seals and checks every
frame and the bootstrap client signs its requests (`transfer/auth.py`); without one, the manager
says so once per process. `guard_stats()` counts what the control plane dropped.

Liveness. Every `heartbeat_interval` the timer pings each peer that has live rooms with this rank
(`_live_peers()`, per side); any message from such a peer counts as a sign of life. A `Ping` is
answered only for a peer this rank knows (live rooms, an open socket to it, or `_is_known_peer`,
per side): a stranger's pings never make this rank open sockets to addresses it was handed. A peer
silent for `heartbeat_interval * heartbeat_max_failures` seconds while rooms are live is declared
dead: its rooms fail with a reason naming it (`_on_peer_dead`, per side) and everything cached
about it is forgotten (its socket closed), so a restarted peer starts fresh. Silence is counted in this
process's running time (`transfer/liveness.py`): a rank that was paused does not declare its peers
dead the moment it wakes, before it has read what they sent meanwhile. The timer checks timeouts
(`_tick_timeouts`, per side) and heartbeats every 50 ms.

Idle registrations. Peers without rooms are not pinged (registrations are unauthenticated without a
cluster secret, and pinging every registered address would make this rank open sockets on a
stranger's word). A registration (decode ranks registered with a prefill rank, prefill ranks a
decode rank registered with) whose peer has had no room for `peer_idle_timeout` seconds is dropped
instead, with its engine peer and socket (`registrations_expired`): a node that died idle, or was
restarted on new control ports, leaves nothing behind for longer than that.
"""

from __future__ import annotations

import logging
import threading
import time

from common.cluster_secret import warn_unauthenticated
from transfer.auth import Authenticator
from transfer.backends import create_engine
from transfer.base import KVArgs, KVPoll, KVTransferError, TransferSettings
from transfer.bootstrap import BootstrapClient
from transfer.control import ControlPlane, Message, Ping, Pong
from transfer.engine import TransferEngine
from transfer.liveness import Liveness
from transfer.memory import HOST
from transfer.plan import union

logger = logging.getLogger(__name__)

TICK = 0.05
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def registrations(args: KVArgs) -> list[tuple[int, int, str]]:
    """(ptr, length, memory kind) of what a rank registers: the union of its spans, per memory kind
    (page-first
    kv buffers interleave, so one registration covers the whole pool; on a GPU the kv and state spans are
    device memory and the metadata rows host memory, registered apart)."""
    by_kind: dict[str, tuple[list[int], list[int]]] = {}
    for kind, ptrs, lens in ((args.kv_memory, args.kv_data_ptrs, args.kv_data_lens),
                             (HOST, args.aux_data_ptrs, args.aux_data_lens),
                             (args.state_memory, args.state_data_ptrs, args.state_data_lens)):
        spans = by_kind.setdefault(kind, ([], []))
        spans[0].extend(ptrs)
        spans[1].extend(lens)
    return [(ptr, n, kind) for kind, (ptrs, lens) in by_kind.items() for ptr, n in union(ptrs, lens)]


class KVManager:
    """Base of `PrefillKVManager` and `DecodeKVManager`; `backend` is a backend name or a built
    engine. Settings come from `settings`, else `TransferSettings.from_env(**overrides)`.

    A subclass names its `side` and `peer_side` and implements the hooks below: `_init_side()`
    (state its message handlers need, set before the control plane starts delivering),
    `_start_side()` (once the control plane listens), `_close_side()`, `_dispatch(msg)` (every
    message but heartbeats), and, under the lock, `_tick_timeouts(now)`, `_live_peers()` and
    `_on_peer_dead(addr, rooms, reason)`."""

    side = ""
    peer_side = ""

    def __init__(self, args: KVArgs, backend: str | TransferEngine = "mooncake",
                 settings: TransferSettings | None = None, host: str = "127.0.0.1", **overrides) -> None:
        self.args = args
        self.settings = settings if settings is not None else TransferSettings.from_env(**overrides)
        self.host = host
        self.engine = backend if isinstance(backend, TransferEngine) \
            else create_engine(backend, host, self.settings)
        self.moves_bytes = getattr(self.engine, "moves_bytes", True)
        for ptr, n, memory in registrations(args):
            self.engine.register(ptr, n, memory)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._liveness = Liveness(self.settings.heartbeat_interval, self.settings.heartbeat_window,
                                  f"kv {self.side}")
        self._last_ping = 0.0
        self.pings_ignored = 0
        self.registrations_refused = 0  # RegisterPeers refused by the prefill side (`_on_register`)
        self.registrations_evicted = 0  # idle decode registrations dropped for new ones (`max_decode_peers`)
        self.registrations_expired = 0  # registrations without rooms for `peer_idle_timeout` (`_expire_idle`)
        self._idle_since: dict[str, float] = {}
        secret = self.settings.cluster_secret
        if secret is None:
            warn_unauthenticated(logger, f"the kv {self.side} manager's control plane")
        # the control plane verifies with its own nonce store; the bootstrap client only signs
        self.bootstrap = BootstrapClient(auth=Authenticator(secret, self.settings.auth_window)
                                         if secret else None)
        self._init_side()
        self.control = ControlPlane(host, self._on_message, name=f"kv-{self.side}",
                                    auth=Authenticator(secret, self.settings.auth_window) if secret else None,
                                    max_peers=self.settings.control_max_peers)
        self.address = self.control.address
        self._start_side()
        self._timer = threading.Thread(target=self._timer_loop, name=f"kv-{self.side}-timer", daemon=True)
        self._timer.start()
        logger.info("kv %s manager up: %s engine, control %s, tp %d/%d pp %d/%d, %d layers", self.side,
                    getattr(self.engine, "name", type(self.engine).__name__), self.address, args.engine_rank,
                    args.tp_size, args.pp_rank, args.pp_size, args.num_layers)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._timer.join(timeout=2)
        self._close_side()
        self.control.close()
        self.engine.close()

    # ------------------------------------------------------------------ side hooks
    def _init_side(self) -> None:
        """Set the side's state (before the control plane can deliver a message)."""

    def _start_side(self) -> None:
        """Start the side's work once the control plane listens at `self.address`."""

    def _close_side(self) -> None:
        """Stop the side's threads (the timer has stopped; the control plane and engine close next)."""

    def _dispatch(self, msg: Message) -> None:
        """Handle a message other than a heartbeat (types meant for the other side are ignored)."""
        raise NotImplementedError

    def _tick_timeouts(self, now: float) -> None:
        """Under the lock: fail the rooms whose deadline passed."""
        raise NotImplementedError

    def _live_peers(self) -> dict[str, list]:
        """Under the lock: peer address -> rooms with live transfers through it."""
        raise NotImplementedError

    def _on_peer_dead(self, addr: str, rooms: list, reason: str) -> None:
        """Under the lock: fail `rooms` (those live through `addr`) and forget the side's state of the
        peer."""
        raise NotImplementedError

    def _is_known_peer(self, addr: str) -> bool:
        """Under the lock: the side knows `addr` beyond live rooms and open sockets (e.g. it registered)."""
        return False

    def _idle_registered(self, live: dict[str, list]) -> set[str]:
        """Under the lock: peers the side keeps a registration of and that have no room here (`live`
        is `_live_peers()`)."""
        return set()

    def _expire_peer(self, addr: str) -> None:
        """Under the lock: drop the side's registration of an idle peer (`_expire_idle`)."""

    def _room_stats(self) -> dict[str, int]:
        """Under the lock: the side's open rooms and registrations (`leak_stats`)."""
        return {}

    # ------------------------------------------------------------------ messages
    def _on_message(self, msg: Message) -> None:
        src = msg.src
        with self._lock:
            self._liveness.heard(src, time.monotonic())
            if isinstance(msg, Ping):
                known = self._liveness.watching(src) or self.control.has_peer(src) or self._is_known_peer(src)
                if not known:
                    self.pings_ignored += 1
        if isinstance(msg, Ping):
            if known:
                self.control.send(src, Pong(src=self.address))
        elif not isinstance(msg, Pong):
            self._dispatch(msg)

    def guard_stats(self) -> dict[str, int | float]:
        """What the control plane dropped and why, its sockets, the pings left unanswered, and how long the
        timer was kept from running (`transfer/liveness.py`)."""
        return {**self.control.stats(), "control_pings_ignored": self.pings_ignored,
                "control_registrations_refused": self.registrations_refused,
                "control_registrations_evicted": self.registrations_evicted,
                "control_registrations_expired": self.registrations_expired,
                "transfer_paused_seconds": round(self._liveness.paused_s, 3), **self.leak_stats()}

    def leak_stats(self) -> dict[str, int]:
        """What this rank holds per room and per peer; a drained node has no open or draining room and
        no registration of a peer that is gone (`transfer_peers_registered` <= live peer ranks)."""
        with self._lock:
            return {"transfer_peers_watched": len(self._liveness),
                    "transfer_engine_peers": self.engine.peer_count(), **self._room_stats()}

    # ------------------------------------------------------------------ timeouts and heartbeats
    def _timer_loop(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self._tick(time.monotonic())
            except Exception:
                logger.exception("kv %s timer tick failed", self.side)

    def _tick(self, now: float) -> None:
        s = self.settings
        with self._lock:
            self._tick_timeouts(now)
            live = self._live_peers()
            dead = [(addr, live[addr], silent) for addr, silent in self._liveness.check(live, now)]
            for addr, rooms, silent in dead:
                reason = (f"{self.peer_side} peer {addr} is dead: missed {s.heartbeat_max_failures} "
                          f"heartbeats (silent for {silent:.1f}s)")
                self._on_peer_dead(addr, rooms, reason)
                self._forget_peer(addr)
            ping = now - self._last_ping >= s.heartbeat_interval
            if ping:
                self._last_ping = now
                gone = {d[0] for d in dead}
                targets = [a for a in live if a not in gone]
                self._expire_idle(now, live)
        if ping:
            for addr in targets:
                self.control.send(addr, Ping(src=self.address))

    def _expire_idle(self, now: float, live: dict[str, list]) -> None:
        """Under the lock: forget registrations whose peer has had no room for `peer_idle_timeout`
        seconds. A peer that died idle is not watched by heartbeats (a restarted node comes back on a
        new control address), so without this its registration, engine peer and socket would stay; a
        live one that was only idle registers again on its next room."""
        idle = self._idle_registered(live)
        for addr in list(self._idle_since):
            if addr not in idle:
                del self._idle_since[addr]
        timeout = self.settings.peer_idle_timeout
        for addr in idle:
            since = self._idle_since.setdefault(addr, now)
            if now - since > timeout:
                del self._idle_since[addr]
                self.registrations_expired += 1
                logger.info("kv %s: %s peer %s had no room for %.0fs (PDSERVE_PEER_IDLE_TIMEOUT): "
                            "registration dropped", self.side, self.peer_side, addr, now - since)
                self._expire_peer(addr)
                self._forget_peer(addr)

    def _forget_peer(self, addr: str) -> None:
        """Under the lock: drop the liveness record and the socket of a dead peer (a new one is made
        if it comes back)."""
        self._liveness.forget(addr)
        self.control.drop(addr)


class KVRoom:
    """What a `KVSender` and a `KVReceiver` share: one request (room) on one manager, its poll state
    and why it failed. Each side implements `_fail(reason)`, called under the manager's lock."""

    def __init__(self, mgr: KVManager, room: int) -> None:
        self.mgr = mgr
        self.room = room
        self._created = time.monotonic()
        self._status = KVPoll.Bootstrapping
        self._reason = ""

    def poll(self) -> KVPoll:
        return self._status

    def failure_exception(self) -> Exception:
        return KVTransferError(self.room, self._reason or "room has not failed")

    def abort(self) -> None:
        with self.mgr._lock:
            self._fail(f"aborted by the {self.mgr.side} side")

    def _fail(self, reason: str) -> None:
        raise NotImplementedError
