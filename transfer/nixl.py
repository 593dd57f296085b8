"""NIXL backend: one-sided WRITEs through a NIXL agent with its UCX plugin.

* `register` registers a region with the agent by its memory kind: host memory as "DRAM", CUDA
  device N's as "VRAM" with device id N (NIXL's UCX plugin then moves it with UCX's cuda_ipc /
  cuda_copy transports on one host and GPUDirect RDMA across hosts, where the NICs support it).
* `describe()` is the agent's full metadata (connection info + registered regions), msgpack-framed
  with the agent name so a repeated `add_peer` is a cheap no-op.
* `add_peer` loads the remote metadata and returns the remote agent name.
* `write` builds Nx3 (addr, len, device id) descriptor lists for both sides, each with its side's
  memory type,, creates a WRITE request,
  posts it and polls it to DONE (NIXL's own progress thread drives UCX); "ERR" or the timeout
  raises `TransferError`. Lists are not prepped once (`prep_xfer_dlist`): the region set differs
  on every call and prepping pays off only for a fixed descriptor grid, which this interface does
  not carry. Building both lists is one numpy fill per batch.

Progress thread: NIXL's UCX plugin runs a shared progress thread that sleeps up to `pthrDelay` us
between polls, but nixl's Python `nixl_agent` hard-codes `pthrDelay = 0`, so the thread busy-spins a
whole core for the agent's life, idle or not. On a 2-core host that halves loopback throughput
(24 MB: ~2.5 GB/s instead of ~4.3 GB/s) and takes a core from the model. `_make_agent` builds the
agent with a delay of 100 us (~2% of a core when idle) by handing the wrapper a config class whose
`pthrDelay` ignores the wrapper's 0, swapped in under a lock for the construction only.

Settings: `device_name` becomes the UCX plugin's `device_list` (RDMA device names such as
"mlx5_0,mlx5_1"; NIXL 1.5 appends the port ":1" itself, and ignores the older `ucx_devices`); the
usual UCX environment (UCX_TLS, UCX_NET_DEVICES, UCX_KEEPALIVE_INTERVAL) is honoured by NIXL's
bundled UCX. NIXL_LOG_LEVEL controls NIXL's logging. Packages: `nixl` and `nixl-cu12`, both with
--no-deps.

Where it listens: UCX's tcp transport listens on every interface's address it may use. Unless
`device_name` or UCX_NET_DEVICES picks the devices, the UCX backend is created with UCX_NET_DEVICES
= the interface holding `hostname` plus the RDMA ports (`ucx_net_devices`; the plugin has no
parameter for network interfaces, so the variable is set for the creation only, under a lock), so a
node told 127.0.0.1 listens on 127.0.0.1 only. The abstract unix sockets UCX also opens (`@...`)
are reachable only from the same network namespace. Remote writes reach only registered memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence

import msgspec
import numpy as np

from transfer.engine import BackendUnavailable, TransferEngine, TransferError, poll_pause, ucx_net_devices
from transfer.memory import HOST, parse_memory

logger = logging.getLogger(__name__)

_INSTALL_HINT = "install nixl-cu12 and nixl with pip --no-deps"
_PROGRESS_DELAY_US = 100
_AGENT_LOCK = threading.Lock()


def _make_agent(name: str, config):
    """A `nixl_agent` whose progress thread waits `_PROGRESS_DELAY_US` between polls (see above)."""
    from nixl import _api

    base = _api.nixlBind.nixlAgentConfig

    class _Config(base):
        pthrDelay = property(base.pthrDelay.__get__,
                             lambda self, _ignored: base.pthrDelay.__set__(self, _PROGRESS_DELAY_US))

    with _AGENT_LOCK:
        _api.nixlBind.nixlAgentConfig = _Config
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base


@contextlib.contextmanager
def _ucx_net_devices_env(devices: str | None):
    """UCX_NET_DEVICES=devices while a UCX context is created (nothing to do for None)."""
    if devices is None:
        yield
        return
    with _AGENT_LOCK:
        os.environ["UCX_NET_DEVICES"] = devices
        try:
            yield
        finally:
            os.environ.pop("UCX_NET_DEVICES", None)


def _nixl_memory(memory: str) -> tuple[str, int]:
    """NIXL's (memory type, device id) for a memory kind: host memory is "DRAM" (device 0), CUDA device
    N's memory "VRAM" with device id N."""
    kind, device = parse_memory(memory)
    return ("DRAM", 0) if kind == HOST else ("VRAM", device)


class _Description(msgspec.Struct, array_like=True):
    agent_name: str
    metadata: bytes


class NixlEngine(TransferEngine):
    name = "nixl"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        device_name: str | None = None,
        timeout: float = 30.0,
        num_threads: int = 0,
    ) -> None:
        super().__init__(hostname, device_name)
        try:
            from nixl._api import nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise BackendUnavailable(f"nixl backend needs nixl: {_INSTALL_HINT} ({exc})") from exc
        self.timeout = timeout
        self._agent_name = f"pdserve-{hostname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # STRICT: NIXL serialises its own API calls, so writer threads need no lock around it.
        config = nixl_agent_config(
            enable_prog_thread=True,
            backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = _make_agent(self._agent_name, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise BackendUnavailable(f"nixl has no UCX plugin: {_INSTALL_HINT}")
        params: dict[str, str] = {}
        net_devices = None
        if device_name:
            params["device_list"] = device_name
            why = f"RDMA devices {device_name} (as configured)"
        else:
            net_devices, why = ucx_net_devices(hostname)
        if num_threads > 0:
            params["num_threads"] = str(num_threads)
        logger.info("nixl engine for %s: %s", hostname, why)
        with _ucx_net_devices_env(net_devices):
            self._agent.create_backend("UCX", params)
        self._lock = threading.Lock()
        self._reg_descs: list[object] = []
        self._peers: set[str] = set()

    def register(self, ptr: int, length: int, memory: str = HOST) -> None:
        mem_type, device = _nixl_memory(memory)
        try:
            descs = self._agent.register_memory([(ptr, length, device, "")], mem_type)
        except Exception as exc:  # nixlBind raises its own types; a VRAM region needs NIXL's CUDA support
            raise TransferError(f"nixl could not register {length} bytes of {memory} memory at "
                                f"{ptr:#x}: {exc}") from exc
        with self._lock:
            self._reg_descs.append(descs)

    def describe(self) -> bytes:
        md = self._agent.get_agent_metadata()
        return msgspec.msgpack.encode(_Description(self._agent_name, bytes(md)))

    def add_peer(self, description: bytes) -> str:
        desc = msgspec.msgpack.decode(description, type=_Description)
        with self._lock:
            if desc.agent_name not in self._peers:
                name = self._agent.add_remote_agent(desc.metadata)
                name = name.decode() if isinstance(name, bytes) else name
                if name != desc.agent_name:
                    raise TransferError(f"nixl metadata names agent {name!r}, expected {desc.agent_name!r}")
                self._peers.add(name)
        return desc.agent_name

    def _dlist(self, addrs: Sequence[int], lengths: Sequence[int], memory: str):
        mem_type, device = _nixl_memory(memory)
        arr = np.empty((len(addrs), 3), dtype=np.uint64)
        arr[:, 0] = addrs
        arr[:, 1] = lengths
        arr[:, 2] = device
        return self._agent.get_xfer_descs(arr, mem_type)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = HOST, dst_memory: str = HOST) -> None:
        if not (len(src) == len(dst) == len(lengths)):
            raise ValueError("src, dst and lengths must have the same length")
        keep = [i for i, n in enumerate(lengths) if n > 0]
        if not keep:
            return
        with self._lock:
            known = peer in self._peers
        if not known:
            raise TransferError(f"unknown nixl peer {peer!r}")
        local = self._dlist([src[i] for i in keep], [lengths[i] for i in keep], src_memory)
        remote = self._dlist([dst[i] for i in keep], [lengths[i] for i in keep], dst_memory)
        try:
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception as exc:  # nixlBind raises its own exception types (e.g. nixlNotFoundError)
            raise TransferError(f"nixl could not create a WRITE to {peer}: {exc}") from exc
        try:
            self._run(handle, peer)
        finally:
            self._release(handle)

    def _run(self, handle, peer: str) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            state, polls = self._agent.transfer(handle), 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"nixl write to {peer} timed out after {self.timeout:.1f}s")
                poll_pause(polls)
                polls += 1
                state = self._agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"nixl write to {peer} failed: {exc}") from exc
        if state != "DONE":
            raise TransferError(f"nixl write to {peer} failed (state {state})")

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            # A request NIXL cannot abort yet: the handle's finaliser parks it on the agent's leak
            # list, which NIXL frees when the agent is destroyed. The write already failed loudly.
            return

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            if peer not in self._peers:
                return
            self._peers.discard(peer)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:
            raise TransferError(f"nixl could not forget {peer}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers), set()
            descs, self._reg_descs = self._reg_descs, []
        for peer in peers:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:
                pass  # the peer may already be gone; close must release everything else regardless
        for d in descs:
            self._agent.deregister_memory(d)
