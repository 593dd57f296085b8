"""KVManager, KVSender and KVReceiver: the transfer protocol, written once on top of any engine.

Roles. A prefill rank's manager registers its control address with its node's bootstrap server and
pushes KV pages into decode ranks; a decode rank's manager looks the prefill ranks up through the
bootstrap server, tells them where each request's pages must land (`TransferInfo`) and waits for
their `Status`.

Parallel layouts. Rank r of tp T holds kv heads [r*H/T, (r+1)*H/T). Every (prefill, decode) pair of
ranks whose head ranges overlap exchanges the overlapping head slice of every page; the decode rank
sends its TransferInfo to each overlapping prefill rank (of every prefill pp stage) and the prefill
sender of a room waits for all overlapping decode ranks. State buffers (hybrid models) are split
along their leading dimension the same way. The metadata row is written by one prefill rank per
decode rank: the lowest overlapping tp rank of the last pp stage. Prefill pp stages write their own
layers at their `start_layer`; the decode side runs pp 1.

Chunks. `send()` takes the next pages of the request (full pages before the last chunk; the last
adds the partial page, the state slots and the metadata row) and enqueues a job on the manager's
worker threads; a job turns the pages into regions and issues one engine `write()` per decode rank
covering all layers, K and V. Regions are (page or head slice of a page) x (buffer), placed by each
side's page stride, then every region that continues the previous one on both sides is merged into
it: runs of pages merge in a per-layer layout, and in the page-first pool all layers' K and V of a
run of pages become one region (head slices of M:N TP stay apart, being not adjacent). When the last
chunk and all earlier ones are done, the sender reports Success to the decode ranks; the receiver
then checks the metadata row's room.

States. Sender: Bootstrapping (waiting for TransferInfo of every overlapping decode rank) ->
WaitingForInput (ready, more chunks expected) -> Transferring (last chunk queued) -> Success.
Receiver: Bootstrapping (resolving prefill ranks) -> WaitingForInput (resolved, `init()` not called)
-> Transferring (TransferInfo sent) -> Success. Any side can end in Failed with a reason: engine
error, peer silent past the heartbeat window, timeouts, abort by either side, room mismatch,
layout mismatch, injected failure (`DISAGGREGATION_TEST_FAILURE_PROB`).

Heartbeats: see `transfer/control.py`. A timer thread per manager checks timeouts and heartbeats
every 50 ms; a decode manager also runs a resolver thread for bootstrap lookups.
"""

from __future__ import annotations

import ctypes
import logging
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from transfer.backends import create_engine
from transfer.base import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferError,
    TransferSettings,
)
from transfer.bootstrap import BootstrapClient, BootstrapError
from transfer.control import (
    Abort,
    ControlPlane,
    Ping,
    Pong,
    RegisterPeer,
    Status,
    TransferInfo,
    peer_registration,
)
from transfer.engine import TransferEngine, TransferError
from transfer.plan import PairPlan, ranks_overlapping, union

logger = logging.getLogger(__name__)

_TICK = 0.05
_FINISHED_CAP = 20000
_TERMINAL = (KVPoll.Success, KVPoll.Failed)


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


@dataclass
class _SendRoom:
    room: int
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    num_pages: int | None = None
    metadata_index: int = -1
    targets: dict[int, TransferInfo] | None = None
    queued: list[_Chunk] = field(default_factory=list)
    next_offset: int = 0
    outstanding: int = 0
    last_enqueued: bool = False
    inject: bool = False
    bytes_sent: int = 0


@dataclass
class _Target:
    tp_rank: int
    pp_rank: int
    addr: str
    writes_metadata: bool


@dataclass
class _RecvRoom:
    room: int
    bootstrap_addr: str
    dp_rank: int
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    problem: str = "bootstrap server not answering yet"
    targets: list[_Target] | None = None
    params: tuple[list[int], int, list[int]] | None = None
    sent_at: float | None = None
    pending: set[tuple[int, int]] = field(default_factory=set)


class KVManager(BaseKVManager):
    """One per rank. `role` is "prefill" or "decode"; `backend` a backend name or a built engine.

    Prefill needs `bootstrap_addr` ("host:port" of its node's bootstrap server) to register with.
    Settings come from `settings`, else `TransferSettings.from_env(**overrides)`."""

    def __init__(self, args: KVArgs, role: str, backend: str | TransferEngine = "mooncake",
                 settings: TransferSettings | None = None, host: str = "127.0.0.1",
                 bootstrap_addr: str | None = None, **overrides) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if role == "decode" and args.pp_size != 1:
            raise ValueError("decode ranks must run pipeline parallel size 1")
        if role == "prefill" and args.pp_size > 1 and args.state_data_ptrs:
            raise ValueError("hybrid state transfer with prefill pipeline parallelism is not supported")
        if role == "prefill" and not bootstrap_addr:
            raise ValueError("a prefill KVManager needs bootstrap_addr (its node's bootstrap server)")
        self.args = args
        self.role = role
        self.settings = settings if settings is not None else TransferSettings.from_env(**overrides)
        self.host = host
        self.engine = backend if isinstance(backend, TransferEngine) else create_engine(backend, host, self.settings)
        self.moves_bytes = getattr(self.engine, "moves_bytes", True)
        # page-first kv buffers interleave: one registration covers the whole pool
        for ptr, n in union(args.kv_data_ptrs + args.aux_data_ptrs + args.state_data_ptrs,
                             args.kv_data_lens + args.aux_data_lens + args.state_data_lens):
            self.engine.register(ptr, n)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=self.settings.num_workers, thread_name_prefix=f"kv-{role}")
        self._register_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-{role}-register")
        self._last_heard: dict[str, float] = {}
        self._tracked_since: dict[str, float] = {}
        self._last_ping = 0.0
        self._ping_seq = 0
        self._finished: OrderedDict[int, str | None] = OrderedDict()
        # prefill state
        self._decode_peers: dict[str, _DecodePeer] = {}
        self._infos: dict[int, dict[int, TransferInfo]] = {}
        self._info_time: dict[int, float] = {}
        self._senders: dict[int, _SendRoom] = {}
        # decode state
        self._receivers: dict[int, _RecvRoom] = {}
        self._registered_with: set[str] = set()
        self.bootstrap = BootstrapClient()
        self._resolve_wake = threading.Event()

        self.control = ControlPlane(host, self._on_message, name=f"kv-{role}")
        self.address = self.control.address
        self.bootstrap_addr = bootstrap_addr
        if role == "prefill":
            self._register_with_bootstrap(bootstrap_addr)
        self._timer = threading.Thread(target=self._timer_loop, name=f"kv-{role}-timer", daemon=True)
        self._timer.start()
        self._resolver = None
        if role == "decode":
            self._resolver = threading.Thread(target=self._resolve_loop, name="kv-decode-resolver", daemon=True)
            self._resolver.start()
        logger.info("kv %s manager up: %s engine, control %s, tp %d/%d pp %d/%d, %d layers", role,
                    getattr(self.engine, "name", type(self.engine).__name__), self.address, args.engine_rank,
                    args.tp_size, args.pp_rank, args.pp_size, args.num_layers)

    # ------------------------------------------------------------------ public helpers
    def create_sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    def create_receiver(self, bootstrap_addr: str, room: int, prefill_dp_rank: int = 0) -> KVReceiver:
        return KVReceiver(self, bootstrap_addr, room, prefill_dp_rank)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._resolve_wake.set()
        self._timer.join(timeout=2)
        if self._resolver is not None:
            self._resolver.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._register_pool.shutdown(wait=False, cancel_futures=True)
        self.control.close()
        self.engine.close()

    # ------------------------------------------------------------------ bootstrap
    def _register_with_bootstrap(self, bootstrap_addr: str) -> None:
        a = self.args
        info = {"role": "prefill", "tp_rank": a.engine_rank, "tp_size": a.tp_size, "dp_rank": a.dp_rank,
                "dp_size": a.dp_size, "pp_rank": a.pp_rank, "pp_size": a.pp_size, "rank_ip": self.host,
                "rank_port": self.control.port, "page_size": a.page_size, "model": a.model,
                "kv_layout": a.kv_layout, "kv_heads_total": a.total_kv_heads, "start_layer": a.start_layer,
                "num_layers": a.num_layers}
        deadline = time.monotonic() + 30.0
        while True:
            try:
                self.bootstrap.register(bootstrap_addr, info)
                return
            except BootstrapError:
                self.control.close()
                raise
            except OSError as e:
                if time.monotonic() > deadline:
                    self.control.close()
                    raise BootstrapError(f"bootstrap server {bootstrap_addr} unreachable: {e}") from e
                time.sleep(0.1)

    # ------------------------------------------------------------------ message dispatch
    def _on_message(self, msg) -> None:
        now = time.monotonic()
        self._last_heard[msg.src] = now
        if isinstance(msg, Ping):
            self.control.send(msg.src, Pong(src=self.address, seq=msg.seq))
        elif isinstance(msg, Pong):
            return
        elif isinstance(msg, RegisterPeer):
            self._on_register(msg)
        elif isinstance(msg, TransferInfo):
            self._on_info(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)
        elif isinstance(msg, Status):
            self._on_status(msg)

    # ------------------------------------------------------------------ prefill side
    def _check_peer(self, reg: RegisterPeer) -> str | None:
        a = self.args
        if reg.page_size != a.page_size:
            return f"page size mismatch: prefill {a.page_size}, decode {reg.page_size}"
        if a.model and reg.model and a.model != reg.model:
            return f"model mismatch: prefill {a.model!r}, decode {reg.model!r}"
        if reg.total_kv_heads != a.total_kv_heads:
            return f"kv head count mismatch: prefill {a.total_kv_heads}, decode {reg.total_kv_heads}"
        if reg.total_kv_heads % reg.tp_size:
            return f"{reg.total_kv_heads} kv heads cannot be split over decode tp {reg.tp_size}"
        if len(reg.kv_item_strides) != len(reg.kv_ptrs) or len(reg.kv_item_lens) != len(reg.kv_ptrs):
            return "decode kv buffer description is inconsistent (pointers, item lengths, strides)"
        if reg.kv_item_lens[0] // reg.kv_head_num != a.head_bytes:
            return f"head bytes mismatch: prefill {a.head_bytes}, decode {reg.kv_item_lens[0] // reg.kv_head_num}"
        if len(reg.kv_ptrs) // 2 < a.start_layer + a.num_layers:
            return (f"decode holds {len(reg.kv_ptrs) // 2} layers, prefill layers "
                    f"{a.start_layer}..{a.start_layer + a.num_layers - 1}")
        if len(reg.aux_ptrs) != len(a.aux_data_ptrs) or list(reg.aux_item_lens) != list(a.aux_item_lens):
            return "metadata buffer layout differs between prefill and decode"
        if len(reg.state_ptrs) != len(a.state_data_ptrs):
            return f"state buffer count mismatch: prefill {len(a.state_data_ptrs)}, decode {len(reg.state_ptrs)}"
        for j in range(len(reg.state_ptrs)):
            ds, dd = a.state_dim_per_tensor[j], reg.state_dims[j]
            if ds * a.tp_size != dd * reg.tp_size or a.state_item_lens[j] // ds != reg.state_item_lens[j] // dd:
                return f"state buffer {j} shape differs between prefill and decode"
        return None

    def _on_register(self, reg: RegisterPeer) -> None:
        """Record the peer at once (so its TransferInfo can queue) and add it to the engine off the
        receiver thread, which must keep answering heartbeats."""
        with self._lock:
            self._decode_peers[reg.src] = _DecodePeer(reg, "", None, None, ready=False)
        self._register_pool.submit(self._complete_register, reg)

    def _complete_register(self, reg: RegisterPeer) -> None:
        error = self._check_peer(reg)
        handle, plan = "", None
        if error is None:
            try:
                handle = self.engine.add_peer(reg.engine_desc)
                plan = PairPlan(self.args, reg)
            except Exception as e:  # engine could not reach or parse the peer
                error = f"engine could not add decode peer: {e}"
        if error:
            logger.error("decode peer %s (tp %d) rejected: %s", reg.src, reg.tp_rank, error)
        else:
            logger.info("decode peer %s registered (tp %d/%d)", reg.src, reg.tp_rank, reg.tp_size)
        with self._lock:
            peer = self._decode_peers.get(reg.src)
            if peer is None or peer.reg is not reg:
                return  # forgotten (declared dead) or re-registered meanwhile
            peer.handle, peer.error, peer.plan, peer.ready = handle, error, plan, True
            for room, infos in list(self._infos.items()):
                if any(i.src == reg.src for i in infos.values()):
                    self._check_ready(room)

    def _on_info(self, info: TransferInfo) -> None:
        with self._lock:
            if info.room in self._finished:
                reason = self._finished[info.room]
                if reason is not None:
                    self.control.send(info.src, Status(src=self.address, room=info.room, ok=False, reason=reason,
                                                       tp_rank=self.args.engine_rank, pp_rank=self.args.pp_rank))
                return
            if info.src not in self._decode_peers:
                reason = "decode rank is not registered with this prefill rank (prefill restarted?)"
                self.control.send(info.src, Status(src=self.address, room=info.room, ok=False, reason=reason,
                                                   tp_rank=self.args.engine_rank, pp_rank=self.args.pp_rank))
                return
            self._infos.setdefault(info.room, {})[info.tp_rank] = info
            self._info_time.setdefault(info.room, time.monotonic())
            logger.info("room %d: TransferInfo from decode tp %d (%d pages)", info.room, info.tp_rank,
                        len(info.dst_page_indices))
            self._check_ready(info.room)

    def _on_abort(self, msg: Abort) -> None:
        with self._lock:
            sr = self._senders.get(msg.room)
            reason = f"aborted by the decode side: {msg.reason}"
            if sr is not None:
                self._fail_send(sr, reason)
            elif msg.room not in self._finished:
                self._remember(msg.room, reason)
                self._infos.pop(msg.room, None)
                self._info_time.pop(msg.room, None)
                logger.info("room %d: aborted by the decode side before the sender existed", msg.room)

    def _remember(self, room: int, reason: str | None) -> None:
        self._finished[room] = reason
        while len(self._finished) > _FINISHED_CAP:
            self._finished.popitem(last=False)

    def _new_sender(self, room: int) -> _SendRoom:
        with self._lock:
            sr = _SendRoom(room=room, created=time.monotonic())
            sr.inject = self.settings.failure_prob > 0 and random.random() < self.settings.failure_prob
            self._senders[room] = sr
            reason = self._finished.pop(room, None)
            if reason is not None:
                sr.status, sr.reason = KVPoll.Failed, reason
                del self._senders[room]
                self._remember(room, reason)
                logger.info("room %d: sender created for a room already failed: %s", room, reason)
            return sr

    def _expected_decode_ranks(self, decode_tp: int) -> list[int]:
        a = self.args
        lo = a.engine_rank * a.kv_head_num
        return ranks_overlapping(lo, lo + a.kv_head_num, a.total_kv_heads, decode_tp)

    def _check_ready(self, room: int) -> None:
        """Under the lock: if the sender has init() and every overlapping decode rank's info, start."""
        sr = self._senders.get(room)
        infos = self._infos.get(room)
        if sr is None or not infos or sr.targets is not None or sr.status in _TERMINAL or sr.num_pages is None:
            return
        decode_tp = next(iter(infos.values())).tp_size
        if any(i.tp_size != decode_tp for i in infos.values()):
            self._fail_send(sr, "decode ranks disagree on their tp size", notify=infos)
            return
        if self.args.total_kv_heads % decode_tp:
            self._fail_send(sr, f"{self.args.total_kv_heads} kv heads cannot be split over decode tp {decode_tp}",
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
            elif len(info.dst_page_indices) != sr.num_pages:
                problem = (f"page count mismatch: prefill sends {sr.num_pages} pages, decode tp {r} allocated "
                           f"{len(info.dst_page_indices)}")
            if problem:
                self._fail_send(sr, problem, notify=targets)
                return
        sr.targets = targets
        self._infos.pop(room, None)
        self._info_time.pop(room, None)
        if sr.inject:
            self._fail_send(sr, f"injected failure (DISAGGREGATION_TEST_FAILURE_PROB={self.settings.failure_prob})")
            return
        sr.status = KVPoll.Transferring if sr.last_enqueued else KVPoll.WaitingForInput
        logger.info("room %d: ready to send to decode tp ranks %s", room, sorted(targets))
        queued, sr.queued = sr.queued, []
        for chunk in queued:
            self._pool.submit(self._run_chunk, sr, chunk)

    def _sender_init(self, sr: _SendRoom, num_kv_pages: int, metadata_index: int) -> None:
        with self._lock:
            sr.num_pages = num_kv_pages
            sr.metadata_index = metadata_index
            self._check_ready(sr.room)

    def _sender_send(self, sr: _SendRoom, page_indices, state_indices, last: bool) -> None:
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        states = None if state_indices is None else np.asarray(state_indices, dtype=np.int64).reshape(-1)
        with self._lock:
            if sr.status in _TERMINAL:
                return
            if sr.num_pages is None:
                raise RuntimeError(f"room {sr.room}: send() before init()")
            if sr.last_enqueued:
                self._fail_send(sr, "send() after the last chunk")
                return
            if pages.size and pages.min() <= 0:
                self._fail_send(sr, "page 0 is the padding page and is never transferred")
                return
            if sr.next_offset + pages.size > sr.num_pages:
                self._fail_send(sr, f"more pages sent ({sr.next_offset + pages.size}) than declared ({sr.num_pages})")
                return
            chunk = _Chunk(sr.next_offset, pages, states, last)
            sr.next_offset += pages.size
            sr.outstanding += 1
            if last:
                sr.last_enqueued = True
                if sr.next_offset != sr.num_pages:
                    sr.outstanding -= 1
                    self._fail_send(sr, f"last chunk ends at {sr.next_offset} pages, init() declared {sr.num_pages}")
                    return
            if sr.targets is None:
                sr.queued.append(chunk)
            else:
                if last and sr.status == KVPoll.WaitingForInput:
                    sr.status = KVPoll.Transferring
                self._pool.submit(self._run_chunk, sr, chunk)

    def _run_chunk(self, sr: _SendRoom, chunk: _Chunk) -> None:
        try:
            if sr.status in _TERMINAL:
                return
            n = chunk.pages.size
            for rank, info in sr.targets.items():
                peer = self._decode_peers.get(info.src)
                if peer is None or peer.plan is None:
                    raise TransferError(f"decode rank tp {rank} ({info.src}) is gone")
                plan = peer.plan
                dst_pages = np.asarray(info.dst_page_indices[chunk.offset: chunk.offset + n], dtype=np.int64)
                if dst_pages.size and dst_pages.min() <= 0:
                    raise TransferError("page 0 is the padding page and is never transferred")
                src, dst, lens = plan.kv_regions(chunk.pages, dst_pages)
                if chunk.last:
                    s_idx = chunk.state_indices if chunk.state_indices is not None else np.zeros(0, np.int64)
                    if s_idx.size != len(info.state_indices):
                        raise TransferError(f"state slot count mismatch: prefill {s_idx.size}, decode tp {rank} "
                                            f"{len(info.state_indices)}")
                    a, b, c = plan.state_regions(s_idx, np.asarray(info.state_indices, dtype=np.int64))
                    src += a
                    dst += b
                    lens += c
                    if info.expects_metadata and plan.aux:
                        a, b, c = plan.aux_regions(sr.metadata_index, info.metadata_index)
                        src += a
                        dst += b
                        lens += c
                if sr.status in _TERMINAL:
                    return
                self.engine.write(peer.handle, src, dst, lens)
                with self._lock:
                    sr.bytes_sent += sum(lens)
        except TransferError as e:
            with self._lock:
                self._fail_send(sr, f"transfer failed: {e}")
        except Exception as e:
            logger.exception("room %d: chunk job crashed", sr.room)
            with self._lock:
                self._fail_send(sr, f"transfer failed: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                sr.outstanding -= 1
                if sr.last_enqueued and sr.outstanding == 0 and sr.status not in _TERMINAL:
                    sr.status = KVPoll.Success
                    self._senders.pop(sr.room, None)
                    self._remember(sr.room, None)
                    for info in sr.targets.values():
                        self.control.send(info.src, Status(src=self.address, room=sr.room, ok=True, reason="",
                                                           tp_rank=self.args.engine_rank, pp_rank=self.args.pp_rank))
                    logger.info("room %d: sent %d bytes, Success", sr.room, sr.bytes_sent)

    def _fail_send(self, sr: _SendRoom, reason: str, notify: dict[int, TransferInfo] | None = None) -> None:
        """Under the lock: fail a sender room and tell every decode rank we know of."""
        if sr.status in _TERMINAL:
            return
        sr.status, sr.reason = KVPoll.Failed, reason
        self._senders.pop(sr.room, None)
        self._remember(sr.room, reason)
        peers = dict(self._infos.pop(sr.room, {}))
        self._info_time.pop(sr.room, None)
        peers.update(notify or {})
        peers.update(sr.targets or {})
        for info in peers.values():
            self.control.send(info.src, Status(src=self.address, room=sr.room, ok=False, reason=reason,
                                               tp_rank=self.args.engine_rank, pp_rank=self.args.pp_rank))
        logger.warning("room %d: sender Failed: %s", sr.room, reason)

    # ------------------------------------------------------------------ decode side
    def _new_receiver(self, bootstrap_addr: str, room: int, dp_rank: int) -> _RecvRoom:
        rr = _RecvRoom(room=room, bootstrap_addr=bootstrap_addr, dp_rank=dp_rank, created=time.monotonic())
        with self._lock:
            self._receivers[room] = rr
        self._resolve_wake.set()
        return rr

    def _resolve_loop(self) -> None:
        while not self._stop.is_set():
            self._resolve_wake.wait(timeout=0.1)
            self._resolve_wake.clear()
            with self._lock:
                todo = [rr for rr in self._receivers.values()
                        if rr.status == KVPoll.Bootstrapping and rr.targets is None]
            groups: dict[tuple[str, int], list[_RecvRoom]] = {}
            for rr in todo:
                groups.setdefault((rr.bootstrap_addr, rr.dp_rank), []).append(rr)
            for (addr, dp), rooms in groups.items():
                targets, problem, fatal = self._resolve(addr, dp)
                with self._lock:
                    for rr in rooms:
                        if rr.status in _TERMINAL:
                            continue
                        if fatal:
                            self._fail_recv(rr, problem)
                        elif targets is None:
                            rr.problem = problem
                        else:
                            rr.targets = targets
                            rr.pending = {(t.tp_rank, t.pp_rank) for t in targets}
                            rr.status = KVPoll.WaitingForInput
                            logger.info("room %d: resolved prefill ranks %s", rr.room,
                                        [(t.tp_rank, t.pp_rank) for t in targets])
                            if rr.params is not None:
                                self._send_infos(rr)
            if todo:
                time.sleep(0.05)

    def _resolve(self, addr: str, dp: int) -> tuple[list[_Target] | None, str, bool]:
        """(targets, problem, fatal) for this decode rank against the prefill node at `addr`."""
        a = self.args
        layout = self.bootstrap.layout(addr)
        if layout is None:
            down = self.bootstrap.unreachable_for(addr)
            if down > self.settings.heartbeat_window:
                # a prefill node the router sent us to was serving moments ago: refused connections
                # for a whole heartbeat window mean it is gone, not starting
                return None, f"bootstrap server {addr} unreachable for {down:.1f}s: prefill node down", True
            return None, f"bootstrap server {addr} has no registered prefill rank or is unreachable", False
        if layout["page_size"] != a.page_size:
            return None, f"page size mismatch: prefill {layout['page_size']}, decode {a.page_size}", True
        if a.model and layout["model"] and layout["model"] != a.model:
            return None, f"model mismatch: prefill {layout['model']!r}, decode {a.model!r}", True
        if layout.get("kv_layout", a.kv_layout) != a.kv_layout:
            return None, f"kv layout mismatch: prefill {layout['kv_layout']!r}, decode {a.kv_layout!r}", True
        total, ptp = layout["kv_heads_total"], layout["tp_size"]
        if total != a.total_kv_heads:
            return None, f"kv head count mismatch: prefill {total}, decode {a.total_kv_heads}", True
        if total % ptp:
            return None, f"{total} kv heads cannot be split over prefill tp {ptp}", True
        if a.state_data_ptrs and layout["pp_size"] > 1:
            return None, "hybrid state transfer with prefill pipeline parallelism is not supported", True
        lo = a.engine_rank * a.kv_head_num
        ranks = ranks_overlapping(lo, lo + a.kv_head_num, total, ptp)
        last_pp = layout["pp_size"] - 1
        targets = []
        for pp in range(layout["pp_size"]):
            for tp in ranks:
                info = self.bootstrap.rank(addr, tp, dp, pp)
                if info is None:
                    return None, f"prefill rank tp {tp} dp {dp} pp {pp} not registered at {addr} yet", False
                targets.append(_Target(tp, pp, f"tcp://{info['rank_ip']}:{info['rank_port']}",
                                       writes_metadata=(pp == last_pp and tp == ranks[0])))
        return targets, "", False

    def _receiver_init(self, rr: _RecvRoom, dst_page_indices, metadata_index: int, state_indices) -> None:
        pages = [int(p) for p in np.asarray(dst_page_indices, dtype=np.int64).reshape(-1)]
        states = [] if state_indices is None else [int(s) for s in np.asarray(state_indices).reshape(-1)]
        with self._lock:
            if rr.status in _TERMINAL:
                return
            if rr.params is not None:
                raise RuntimeError(f"room {rr.room}: init() called twice")
            rr.params = (pages, int(metadata_index), states)
            if rr.targets is not None:
                self._send_infos(rr)

    def _send_infos(self, rr: _RecvRoom) -> None:
        """Under the lock: register with each target prefill rank (once) and send the room's info."""
        a = self.args
        pages, meta, states = rr.params
        for t in rr.targets:
            if t.addr not in self._registered_with:
                reg = peer_registration(a, self.address, self.engine.describe())
                if not self.control.send(t.addr, reg):
                    self._fail_recv(rr, f"cannot reach prefill rank tp {t.tp_rank} at {t.addr}")
                    return
                self._registered_with.add(t.addr)
            info = TransferInfo(src=self.address, room=rr.room, tp_rank=a.engine_rank, tp_size=a.tp_size,
                                dst_page_indices=pages, metadata_index=meta, state_indices=states,
                                expected_pages=len(pages), expects_metadata=t.writes_metadata)
            if not self.control.send(t.addr, info):
                self._fail_recv(rr, f"cannot reach prefill rank tp {t.tp_rank} at {t.addr}")
                return
        rr.sent_at = time.monotonic()
        rr.status = KVPoll.Transferring
        logger.info("room %d: TransferInfo sent to %d prefill rank(s), %d pages", rr.room, len(rr.targets), len(pages))

    def _on_status(self, msg: Status) -> None:
        with self._lock:
            rr = self._receivers.get(msg.room)
            if rr is None or rr.status in _TERMINAL:
                return
            if not msg.ok:
                # tell the other prefill ranks of this room to stop writing into pages about to be freed
                self._fail_recv(rr, f"prefill rank tp {msg.tp_rank} pp {msg.pp_rank}: {msg.reason}")
                return
            rr.pending.discard((msg.tp_rank, msg.pp_rank))
            if rr.pending or rr.params is None:
                return
            problem = self._check_room(rr)
            if problem:
                self._fail_recv(rr, problem)
                return
            rr.status = KVPoll.Success
            self._receivers.pop(rr.room, None)
            logger.info("room %d: receiver Success", rr.room)

    def _check_room(self, rr: _RecvRoom) -> str | None:
        a = self.args
        if not self.moves_bytes or a.aux_room_index < 0:
            return None
        meta = rr.params[1]
        got = ctypes.c_int64.from_address(a.aux_data_ptrs[a.aux_room_index]
                                          + meta * a.aux_item_lens[a.aux_room_index]).value
        if got != rr.room:
            return f"metadata room mismatch: slot {meta} holds room {got}, expected {rr.room}"
        return None

    def _fail_recv(self, rr: _RecvRoom, reason: str) -> None:
        """Under the lock: fail a receiver room and tell its prefill ranks (those already done ignore it)."""
        if rr.status in _TERMINAL:
            return
        rr.status, rr.reason = KVPoll.Failed, reason
        self._receivers.pop(rr.room, None)
        if rr.targets:
            for t in rr.targets:
                self.control.send(t.addr, Abort(src=self.address, room=rr.room, reason=reason))
        logger.warning("room %d: receiver Failed: %s", rr.room, reason)

    # ------------------------------------------------------------------ timeouts and heartbeats
    def _timer_loop(self) -> None:
        while not self._stop.wait(_TICK):
            try:
                self._tick(time.monotonic())
            except Exception:
                logger.exception("kv %s timer tick failed", self.role)

    def _live_peers(self) -> dict[str, list]:
        """Under the lock: peer address -> rooms with live transfers through it."""
        live: dict[str, list] = {}
        if self.role == "prefill":
            for sr in self._senders.values():
                if sr.targets:
                    for info in sr.targets.values():
                        live.setdefault(info.src, []).append(sr)
        else:
            for rr in self._receivers.values():
                if rr.targets and rr.status == KVPoll.Transferring:
                    for t in rr.targets:
                        live.setdefault(t.addr, []).append(rr)
        return live

    def _tick(self, now: float) -> None:
        s = self.settings
        with self._lock:
            # timeouts
            if self.role == "prefill":
                for sr in list(self._senders.values()):
                    if sr.status == KVPoll.Bootstrapping and now - sr.created > s.bootstrap_timeout:
                        self._fail_send(sr, f"no TransferInfo from the decode side within {s.bootstrap_timeout:g}s "
                                            "(PDSERVE_BOOTSTRAP_TIMEOUT)")
                for room in [r for r, t in self._info_time.items()
                             if r not in self._senders and now - t > s.bootstrap_timeout]:
                    self._infos.pop(room, None)
                    self._info_time.pop(room, None)
            else:
                for rr in list(self._receivers.values()):
                    if rr.status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and rr.targets is None \
                            and now - rr.created > s.bootstrap_timeout:
                        self._fail_recv(rr, f"bootstrap timed out after {s.bootstrap_timeout:g}s "
                                            f"(PDSERVE_BOOTSTRAP_TIMEOUT): {rr.problem}")
                    elif rr.status == KVPoll.Transferring and now - rr.sent_at > s.waiting_timeout:
                        self._fail_recv(rr, f"no Success within {s.waiting_timeout:g}s (PDSERVE_WAITING_TIMEOUT)")
            # heartbeats
            live = self._live_peers()
            for addr in list(self._tracked_since):
                if addr not in live:
                    del self._tracked_since[addr]
            for addr in live:
                self._tracked_since.setdefault(addr, now)
            dead = []
            for addr, rooms in live.items():
                seen = max(self._last_heard.get(addr, 0.0), self._tracked_since[addr])
                if now - seen > s.heartbeat_window:
                    dead.append((addr, rooms, now - seen))
            for addr, rooms, silent in dead:
                what = "decode" if self.role == "prefill" else "prefill"
                reason = (f"{what} peer {addr} is dead: missed {s.heartbeat_max_failures} heartbeats "
                          f"(silent for {silent:.1f}s)")
                for room in rooms:
                    if self.role == "prefill":
                        self._fail_send(room, reason)
                    else:
                        self._fail_recv(room, reason)
                self._forget_peer(addr)
            ping = now - self._last_ping >= s.heartbeat_interval
            if ping:
                self._last_ping = now
                self._ping_seq += 1
                targets = [a for a in live if a not in {d[0] for d in dead}]
        if ping:
            for addr in targets:
                self.control.send(addr, Ping(src=self.address, seq=self._ping_seq))

    def _forget_peer(self, addr: str) -> None:
        """Under the lock: drop everything cached about a dead peer, so a restarted one starts fresh."""
        self._tracked_since.pop(addr, None)
        self._last_heard.pop(addr, None)
        if self.role == "prefill":
            peer = self._decode_peers.pop(addr, None)
            if peer is not None and peer.handle:
                try:
                    self.engine.remove_peer(peer.handle)
                except Exception as e:
                    logger.warning("engine could not remove dead peer %s: %s", addr, e)
        else:
            self._registered_with.discard(addr)
            for rr in self._receivers.values():
                if rr.targets and any(t.addr == addr for t in rr.targets):
                    self.bootstrap.invalidate(rr.bootstrap_addr)
        self.control.drop(addr)


class KVSender(BaseKVSender):
    """Prefill side of one request (room)."""

    def __init__(self, mgr: KVManager, room: int) -> None:
        if mgr.role != "prefill":
            raise ValueError("KVSender needs a prefill KVManager")
        self.mgr = mgr
        self.room = room
        self._r = mgr._new_sender(room)

    def init(self, num_kv_pages: int, metadata_index: int) -> None:
        self.mgr._sender_init(self._r, num_kv_pages, metadata_index)

    def send(self, page_indices, state_indices=None, last: bool = False) -> None:
        self.mgr._sender_send(self._r, page_indices, state_indices, last)

    def poll(self) -> KVPoll:
        return self._r.status

    @property
    def bytes_sent(self) -> int:
        return self._r.bytes_sent

    def failure_exception(self) -> Exception:
        return KVTransferError(self.room, self._r.reason or "room has not failed")

    def abort(self) -> None:
        with self.mgr._lock:
            self.mgr._fail_send(self._r, "aborted by the prefill side")


class KVReceiver(BaseKVReceiver):
    """Decode side of one request (room); `bootstrap_addr` is the prefill node's "host:port"."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, room: int, prefill_dp_rank: int = 0) -> None:
        if mgr.role != "decode":
            raise ValueError("KVReceiver needs a decode KVManager")
        self.mgr = mgr
        self.room = room
        self.bootstrap_addr = bootstrap_addr
        self._r = mgr._new_receiver(bootstrap_addr, room, prefill_dp_rank)

    def init(self, dst_page_indices, metadata_index: int, state_indices=None) -> None:
        self.mgr._receiver_init(self._r, dst_page_indices, metadata_index, state_indices)

    def poll(self) -> KVPoll:
        return self._r.status

    def failure_exception(self) -> Exception:
        return KVTransferError(self.room, self._r.reason or "room has not failed")

    def abort(self) -> None:
        with self.mgr._lock:
            self.mgr._fail_recv(self._r, "aborted by the decode side")
