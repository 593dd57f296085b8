"""The byte mover under every real backend.

A backend module (mooncake, nixl, ucx) only has to implement this small class: register local
memory, describe itself to peers, and write batches of (local address -> peer address, length)
regions into a peer's registered memory. Everything above it (control plane, chunking, page
coalescing, TP head slicing, metadata, heartbeats, timeouts) is shared code in `transfer/`, so the
protocol logic is written once and every backend gets the same failure handling.

Memory kinds. Every registration says where its memory lives ("host" or "cuda:N",
`transfer/memory.py`), and every write names the kind of its local and remote regions: a GPU node's
KV pages are device memory, its metadata rows host memory, and an engine registers and moves each
kind its own way.

Writes are one-sided pushes from the prefill side into the decode side's registered buffers.
`write` blocks until the batch is complete (callers run it on a worker thread) and raises
`TransferError` with a reason on any failure.

Where an engine listens. An engine is given the address its node was told to use (`hostname`);
`ucx_net_devices(hostname)` names the UCX devices that keep the UCX-based engines (nixl, ucx) on the
interface holding that address (plus the RDMA ports, which open no TCP listener), so they listen
nowhere else. Mooncake cannot be confined (see `transfer/mooncake.py`).
"""

from __future__ import annotations

import abc
import glob
import ipaddress
import os
import socket
import time
from collections.abc import Sequence

import psutil

from transfer.memory import HOST

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
POLL_FIRST_S = 20e-6
POLL_MAX_S = 500e-6


def poll_pause(n: int) -> None:
    """Sleep before re-polling a write in flight for the n-th time (n from 0): 20 us, doubling to 0.5 ms.
    Over TCP the target's own threads land the bytes (UCX's tcp transport, Mooncake's), and on a small
    host they share the cores with every writer waiting for them: a thread re-polling every 20 us
    takes ~9% of a core (13k wake-ups a second, measured here) before its check even runs, at 0.5 ms
    ~4%, and a prefill node has a writer per rank and worker. A short write is still seen done within
    tens of microseconds, a long one at most 0.5 ms late (bench transfer: the same GB/s)."""
    time.sleep(min(POLL_MAX_S, POLL_FIRST_S * (1 << min(n, 8))))


class TransferError(RuntimeError):
    """A batch write failed; the message says why (peer unreachable, engine error code, ...)."""


class BackendUnavailable(RuntimeError):
    """The backend's library is not installed; the message names the package to install."""


class TransferEngine(abc.ABC):
    """One engine instance per process (per TP rank)."""

    name: str = "abstract"

    def __init__(self, hostname: str = "127.0.0.1", device_name: str | None = None) -> None:
        self.hostname = hostname
        self.device_name = device_name

    @abc.abstractmethod
    def register(self, ptr: int, length: int, memory: str = HOST) -> None:
        """Register [ptr, ptr+length) for remote writes (and as a write source); `memory` is where it
        lives, "host" or "cuda:N" (`transfer/memory.py`). An engine that cannot reach that kind of memory
        raises `BackendUnavailable` naming what to install.

        Must be called for every buffer before `describe()` is sent to peers."""

    @abc.abstractmethod
    def describe(self) -> bytes:
        """Opaque description a peer needs to write into this engine's registered memory
        (address/session id and any remote keys). Sent once per peer over the control plane."""

    @abc.abstractmethod
    def add_peer(self, description: bytes) -> str:
        """Prepare to write into the peer described by `description`; returns a peer handle.
        Idempotent for the same description."""

    @abc.abstractmethod
    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = HOST, dst_memory: str = HOST) -> None:
        """Copy each local region src[i] of lengths[i] bytes to the peer's dst[i]; blocking. Every local
        region is memory of kind `src_memory`, every remote one of `dst_memory` (registered as such)."""

    def remove_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Forget a peer (it died or was deregistered)."""

    def peer_count(self) -> int:
        """Peers added and not removed (0 for an engine that keeps no per-peer state of its own)."""
        return len(getattr(self, "_peers", ()))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""


def host_addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses `host` stands for (an address literal, or what the name resolves to)."""
    try:
        return {ipaddress.ip_address(host.split("%", 1)[0])}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos}


def interfaces_of(host: str) -> list[str]:
    """Names of the local network interfaces that hold one of `host`'s addresses."""
    wanted = host_addresses(host)
    found = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%", 1)[0]) in wanted:
                    found.append(name)
                    break
            except ValueError:
                continue
    return sorted(found)


def rdma_ports() -> list[str]:
    """UCX names ("mlx5_0:1") of this host's RDMA ports; they keep hardware RMA within a confinement."""
    return sorted(f"{p.split('/')[-3]}:{p.split('/')[-1]}"
                  for p in glob.glob("/sys/class/infiniband/*/ports/*"))


def ucx_net_devices(host: str) -> tuple[str | None, str]:
    """(UCX_NET_DEVICES value, why) that keeps a UCX engine's TCP listeners on `host`'s interface.

    None when nothing is to be confined: UCX_NET_DEVICES is already set by the user (who also opts out
    with UCX_NET_DEVICES=all), the host is a wildcard (every interface was asked for), or no local
    interface holds the address (it is then left to UCX, and the reason says so)."""
    if os.environ.get("UCX_NET_DEVICES"):
        return None, f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']} (set by the user)"
    if host in WILDCARD_HOSTS:
        return None, f"{host or 'an empty host'} asks for every interface"
    ifaces = interfaces_of(host)
    if not ifaces:
        return None, f"no local interface holds {host}: UCX listens on every interface"
    devices = ",".join(ifaces + rdma_ports())
    return devices, f"UCX devices {devices} (the interface of {host})"


def thread_ids() -> set[int]:
    """The ids of this process's threads (Linux)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def spread_over_node(tids: set[int]) -> None:
    """Let an engine's own threads (UCX's async and progress threads under ucx and nixl, mooncake's
    workers) run on every core of the node (`PDSERVE_NODE_CORES`, set when a DP group's process is pinned
    to a share of them, common/scheduler/process.py). Those threads spin on locks that this process's
    chunk writers hold while they post and progress; confined with them to a group's single core, a
    spinner kept the holder off the core: in tests with two DP groups on each node (one core each) a ucx
    transfer stalled for minutes, and nixl nodes went silent past the heartbeat window."""
    cores = os.environ.get("PDSERVE_NODE_CORES")
    if not cores:
        return
    node = {int(c) for c in cores.split(",")}
    for tid in tids:
        try:
            os.sched_setaffinity(tid, node)
        except OSError:  # the thread ended meanwhile
            pass
