"""UCX backend: one-sided RMA puts through a UCXX worker.

`ucxx` (pip package `ucxx-cu12`) owns the UCP context, the worker, its progress thread and the
endpoints. Its Python API (0.52) has no RMA calls, so the four RMA verbs it lacks (memory map,
rkey pack/unpack, put, flush) are called with ctypes on the very libucp that ucxx has loaded, using
the raw UCP handles ucxx exposes. The worker is created by ucxx in UCS_THREAD_MODE_MULTI, so those
calls are safe next to ucxx's progress thread and from several writer threads.

* `register` maps the region with `ucp_mem_map`, with its memory type (host, or CUDA: UCX's
  cuda_copy / cuda_ipc transports and GPUDirect RDMA lanes then carry it), and packs its remote key
  (which carries the type to the peer). A put's local buffer type UCX detects from the pointer.
* `describe()` is msgpack of {id, worker address, [(base, length, packed rkey), ...]}.
* `add_peer` creates an endpoint to the worker address (peer error handling on) and unpacks rkeys.
* `write` posts one `ucp_put_nbx` per region, then `ucp_ep_flush_nbx`, and polls the flush while
  progressing the worker; an endpoint error or the timeout raises `TransferError`.

A blocking (epoll) ucxx progress thread runs on every engine, because on transports without
hardware RMA (tcp) UCX emulates puts with active messages and the target's worker must progress.

Endpoints use UCX peer error handling (`error_handling=True`), so a dead peer turns into an endpoint
error and a `TransferError` instead of a fatal UCX abort. UCX 1.21 (the libucx-cu12 that ucxx pins)
offers no shared-memory/CMA lane in that mode, so between two processes on one host puts run as
software RMA over tcp/lo (~0.7 GB/s on a 2-core VM); RDMA lanes (rc/dc) keep hardware RMA.
`error_handling=False` allows shm/CMA (several GB/s locally) but UCX then aborts the whole process
when a peer dies: for single-host benchmarks only.

Settings: UCX reads its usual environment, e.g. UCX_TLS (transports, e.g. "rc,cuda_copy" or
"tcp,sm,self"), UCX_NET_DEVICES (e.g. "mlx5_0:1" or "eth0"), UCX_KEEPALIVE_INTERVAL (how fast a dead
peer is noticed). `device_name`, when given, is applied as UCX_NET_DEVICES for this context only.

Where it listens: UCX's tcp transport listens on every interface's address it may use. Unless
`device_name` or UCX_NET_DEVICES picks the devices, the context gets NET_DEVICES = the interface
holding `hostname` plus the RDMA ports (`ucx_net_devices`), so a node told 127.0.0.1 listens on
127.0.0.1 only. UCX also opens abstract unix sockets (`@...`); those are reachable only from the same
network namespace. A peer's puts reach only memory this engine registered (they need its rkey).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from transfer.engine import BackendUnavailable, TransferEngine, TransferError, poll_pause, ucx_net_devices
from transfer.memory import HOST, parse_memory

logger = logging.getLogger(__name__)

_INSTALL_HINT = "install ucxx-cu12 (pulls libucxx-cu12 and libucx-cu12)"

_UCS_OK = 0
_UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_MEM_MAP_ADDRESS_LENGTH = (1 << 0) | (1 << 1)  # UCP_MEM_MAP_PARAM_FIELD_ADDRESS | _LENGTH
_MEM_MAP_MEMORY_TYPE = 1 << 4  # UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
_UCS_MEMORY_TYPE = {"host": 0, "cuda": 1}  # ucs_memory_type_t: UCS_MEMORY_TYPE_HOST, UCS_MEMORY_TYPE_CUDA


def _ucs_memory_type(memory: str) -> int:
    """UCX's memory type of a memory kind (the device index is the pointer's own: UCX finds it)."""
    return _UCS_MEMORY_TYPE[parse_memory(memory)[0]]


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class _Description(msgspec.Struct, array_like=True):
    engine_id: str
    worker_address: bytes
    regions: list[tuple[int, int, bytes]]


class _Ucp:
    """ctypes view of the libucp already loaded by ucxx (same library instance, same handles)."""

    def __init__(self) -> None:
        import libucx

        lib_dir = os.path.join(os.path.dirname(libucx.__file__), "lib")
        ucp = ctypes.CDLL(os.path.join(lib_dir, "libucp.so"))
        ucs = ctypes.CDLL(os.path.join(lib_dir, "libucs.so"))
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.mem_map = self._fn(ucp.ucp_mem_map, i32, vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp))
        self.mem_unmap = self._fn(ucp.ucp_mem_unmap, i32, vp, vp)
        # ucp_rkey_pack is marked deprecated, but UCX 1.21's ucp_memh_pack only packs exported
        # handles (without the EXPORT flag it aborts), so this is still the call for remote keys.
        self.rkey_pack = self._fn(ucp.ucp_rkey_pack, i32, vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz))
        self.rkey_buffer_release = self._fn(ucp.ucp_rkey_buffer_release, None, vp)
        self.rkey_unpack = self._fn(ucp.ucp_ep_rkey_unpack, i32, vp, ctypes.c_char_p, ctypes.POINTER(vp))
        self.rkey_destroy = self._fn(ucp.ucp_rkey_destroy, None, vp)
        self.put_nbx = self._fn(ucp.ucp_put_nbx, vp, vp, vp, sz, ctypes.c_uint64, vp, vp)
        self.ep_flush_nbx = self._fn(ucp.ucp_ep_flush_nbx, vp, vp, vp)
        self.request_check_status = self._fn(ucp.ucp_request_check_status, i32, vp)
        self.request_cancel = self._fn(ucp.ucp_request_cancel, None, vp, vp)
        self.request_free = self._fn(ucp.ucp_request_free, None, vp)
        self.worker_progress = self._fn(ucp.ucp_worker_progress, ctypes.c_uint, vp)
        self.status_string = self._fn(ucs.ucs_status_string, ctypes.c_char_p, i32)
        # ucp_request_param_t with op_attr_mask == 0: every optional field is ignored by UCX.
        self.no_params = ctypes.create_string_buffer(256)

    @staticmethod
    def _fn(f, restype, *argtypes):
        f.restype = restype
        f.argtypes = list(argtypes)
        return f

    def check(self, status: int, what: str) -> None:
        if status != _UCS_OK:
            raise TransferError(f"{what} failed: {self.status_string(status).decode()}")

    def split_status_ptr(self, ptr: int | None) -> tuple[int | None, int]:
        """Decode a ucs_status_ptr_t into (request pointer or None, status)."""
        if not ptr:
            return None, _UCS_OK
        if ptr >= (1 << 64) + _UCS_ERR_LAST:  # UCS_PTR_IS_ERR: a negative status cast to a pointer
            return None, ptr - (1 << 64)
        return ptr, _UCS_INPROGRESS


@dataclass
class _Peer:
    endpoint: object
    ep_handle: int
    bases: list[int]
    ends: list[int]
    rkeys: list[int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


class UcxEngine(TransferEngine):
    name = "ucx"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        device_name: str | None = None,
        timeout: float = 30.0,
        error_handling: bool = True,
    ) -> None:
        super().__init__(hostname, device_name)
        try:
            from ucxx._lib import libucxx
        except ImportError as exc:
            raise BackendUnavailable(f"ucx backend needs ucxx: {_INSTALL_HINT} ({exc})") from exc
        try:
            self._ucp = _Ucp()
        except (ImportError, OSError) as exc:
            raise BackendUnavailable(f"ucx backend cannot load libucp: {_INSTALL_HINT} ({exc})") from exc
        self._lib = libucxx
        self.timeout = timeout
        self.error_handling = error_handling
        if device_name:
            net_devices, why = device_name, f"UCX devices {device_name} (as configured)"
        else:
            net_devices, why = ucx_net_devices(hostname)
        logger.info("ucx engine for %s: %s", hostname, why)
        config = {"NET_DEVICES": net_devices} if net_devices else None
        self._context = libucxx.UCXContext(config, (libucxx.Feature.RMA, libucxx.Feature.WAKEUP))
        self._worker = libucxx.UCXWorker(self._context)
        self._worker.start_progress_thread(polling_mode=False, epoll_timeout=100)
        self._ctx_h = int(self._context.handle)
        self._worker_h = int(self._worker.handle)
        self._id = f"ucx-{hostname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int, bytes]] = []
        self._memhs: list[int] = []
        self._peers: dict[str, _Peer] = {}

    def register(self, ptr: int, length: int, memory: str = HOST) -> None:
        ucp = self._ucp
        params = _MemMapParams(field_mask=_MEM_MAP_ADDRESS_LENGTH | _MEM_MAP_MEMORY_TYPE, address=ptr,
                               length=length, memory_type=_ucs_memory_type(memory))
        memh = ctypes.c_void_p()
        ucp.check(ucp.mem_map(self._ctx_h, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
        buf, buf_len = ctypes.c_void_p(), ctypes.c_size_t()
        status = ucp.rkey_pack(self._ctx_h, memh, ctypes.byref(buf), ctypes.byref(buf_len))
        if status != _UCS_OK:
            ucp.mem_unmap(self._ctx_h, memh)
            ucp.check(status, "ucp_rkey_pack")
        rkey = ctypes.string_at(buf, buf_len.value)
        ucp.rkey_buffer_release(buf)
        with self._lock:
            self._memhs.append(memh.value)
            self._regions.append((ptr, length, rkey))

    def describe(self) -> bytes:
        with self._lock:
            regions = list(self._regions)
        desc = _Description(self._id, bytes(self._worker.address.tobytes()), regions)
        return msgspec.msgpack.encode(desc)

    def add_peer(self, description: bytes) -> str:
        desc = msgspec.msgpack.decode(description, type=_Description)
        with self._lock:
            if desc.engine_id in self._peers:
                return desc.engine_id
            lib, ucp = self._lib, self._ucp
            address = lib.UCXAddress.create_from_buffer(desc.worker_address)
            endpoint = lib.UCXEndpoint.create_from_worker_address(self._worker, address, self.error_handling)
            ep_h = int(endpoint.handle)
            regions = sorted(desc.regions)
            rkeys: list[int] = []
            for _, _, packed in regions:
                rkey = ctypes.c_void_p()
                status = ucp.rkey_unpack(ep_h, packed, ctypes.byref(rkey))
                if status != _UCS_OK:
                    for r in rkeys:
                        ucp.rkey_destroy(r)
                    endpoint.close_blocking()
                    ucp.check(status, "ucp_ep_rkey_unpack")
                rkeys.append(rkey.value)
            self._peers[desc.engine_id] = _Peer(
                endpoint, ep_h, [r[0] for r in regions], [r[0] + r[1] for r in regions], rkeys
            )
        return desc.engine_id

    def _rkey_for(self, peer: _Peer, addr: int, length: int) -> int:
        i = bisect.bisect_right(peer.bases, addr) - 1
        if i < 0 or addr + length > peer.ends[i]:
            raise TransferError(f"remote range 0x{addr:x}+{length} is outside the peer's registered memory")
        return peer.rkeys[i]

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = HOST, dst_memory: str = HOST) -> None:
        with self._lock:
            p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"unknown ucx peer {peer!r}")
        ucp, deadline = self._ucp, time.monotonic() + self.timeout
        with p.lock:
            if p.closed:
                raise TransferError(f"ucx peer {peer!r} was removed")
            self._check_alive(p, peer)
            for s, d, n in zip(src, dst, lengths, strict=True):
                if n == 0:
                    continue
                req, status = ucp.split_status_ptr(
                    ucp.put_nbx(p.ep_handle, s, n, d, self._rkey_for(p, d, n), ucp.no_params)
                )
                if req is not None:
                    ucp.request_free(req)  # completion is tracked by the flush below
                elif status != _UCS_OK:
                    ucp.check(status, f"ucp_put_nbx to {peer}")
            req, status = ucp.split_status_ptr(ucp.ep_flush_nbx(p.ep_handle, ucp.no_params))
            if req is not None:
                status = self._wait(req, deadline, peer)
            ucp.check(status, f"ucx flush to {peer}")
            self._check_alive(p, peer)

    def _wait(self, req: int, deadline: float, peer: str) -> int:
        ucp, idle = self._ucp, 0
        while True:
            status = ucp.request_check_status(req)
            if status != _UCS_INPROGRESS:
                ucp.request_free(req)
                return status
            if time.monotonic() > deadline:
                ucp.request_cancel(self._worker_h, req)
                ucp.request_free(req)
                raise TransferError(f"ucx write to {peer} timed out after {self.timeout:.1f}s")
            if ucp.worker_progress(self._worker_h):
                idle = 0
            else:
                poll_pause(idle)
                idle += 1

    @staticmethod
    def _check_alive(p: _Peer, peer: str) -> None:
        if not p.endpoint.alive:
            try:
                p.endpoint.raise_on_error()
            except Exception as exc:
                raise TransferError(f"ucx endpoint to {peer} failed: {exc}") from exc
            raise TransferError(f"ucx endpoint to {peer} failed")

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            p = self._peers.pop(peer, None)
        if p is not None:
            self._close_peer(p)

    def _close_peer(self, p: _Peer) -> None:
        with p.lock:
            if p.closed:
                return
            p.closed = True
            for rkey in p.rkeys:
                self._ucp.rkey_destroy(rkey)
            p.endpoint.close_blocking()

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            memhs, self._memhs, self._regions = self._memhs, [], []
        for p in peers:
            self._close_peer(p)
        self._worker.stop_progress_thread()
        for memh in memhs:
            self._ucp.mem_unmap(self._ctx_h, memh)
