"""The `mooncake` backend: Mooncake TransferEngine (pip `mooncake-transfer-engine`, or
`mooncake-transfer-engine-non-cuda` on CPU-only hosts).

The engine runs in P2P-handshake mode (no metadata server): `initialize(host, "P2PHANDSHAKE",
protocol, devices)` starts its RPC listener, and a peer is addressed by the session id
`host:rpc_port`, which is all `describe()` returns. A write submits every region as its own
`batch_transfer_async_write` batch, then waits for them in order with `transfer_check_status`
(1 done, 0 running, -1 failed, -2 timed out after MC_TRANSFER_TIMEOUT) and sleeps growing to 0.5 ms; once all
are finished, any failure raises `TransferError`. One batch per region because
`transfer_check_status` reports (and on completion frees) the batch's first task only, while
`batch_transfer_sync_write` / `get_batch_transfer_status` busy-poll a core until the batch is
done, which on a 2-core host takes CPU from Mooncake's own TCP threads (24 MB in 12 regions:
~20 ms instead of ~12 ms).

Memory kinds. The CUDA build registers device memory as it registers host memory (it finds a
pointer's device itself, and its transports move device memory); the CPU-only build
(`mooncake-transfer-engine-non-cuda`, the pinned CPU default) refuses a cuda kind at registration,
naming the package to install, instead of reading a device address as host memory.

Settings: protocol "tcp" (default; the only one on hosts without RDMA NICs) or "rdma" on clusters
(`TransferSettings.protocol` / PDSERVE_TRANSFER_PROTOCOL); RDMA device names such as "mlx5_0,mlx5_1"
(`device_name` / PDSERVE_TRANSFER_DEVICES; empty = auto-discovery). Large batches need Mooncake's
TCP per-peer queue raised: MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and
MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER default to 65535 here unless already set. The TCP transport
opens (and closes) one connection per region unless MC_TCP_ENABLE_CONNECTION_POOL is set, which
costs ~0.1-0.2 ms a region on loopback and seconds for thousands of regions (head-sliced M:N TP
batches); it defaults to 1 here (~0.03 ms a region).

Where it listens. Mooncake binds both of its listeners to a wildcard address whatever host it is
given, and no setting of 0.3.13 confines them (its sources, mooncake-transfer-engine/src/):
- the P2P handshake / RPC listener: `TransferEngineImpl::init` (transfer_engine_impl.cpp) takes its
  socket from `findAvailableTcpPort` (transfer_metadata_plugin.cpp), which binds INADDR_ANY (IN6ADDR_ANY
  with MC_USE_IPV6); `SocketHandShakePlugin::startDaemon` listens on that socket (or binds the same
  wildcard itself);
- the TCP transport: `TcpTransport::install` (transport/tcp_transport/tcp_transport.cpp) starts a
  `TcpContext` whose acceptor binds `asio::ip::tcp::v6()`, dual stack (:: for IPv4 too), falling back
  to the IPv4 wildcard.
MC_TCP_BIND_ADDRESS is read only in the metadata-server mode, as the address advertised (not bound);
MC_LEGACY_RPC_PORT_BINDING only chooses the port (the handshake mode picks its own anyway);
MC_RDMA_BIND_ADDRESS names the address the RDMA transport advertises. So nothing is set here to confine
them: the engine starts, then looks at what it opened (`_listening`). Every new listener on a specific
address: one info line. A wildcard one while the node was given a specific host: the engine is dropped
(which closes its sockets; no memory is registered yet, and Mooncake's TCP server serves only addresses
within registered buffers, so nothing was reachable) and `UnconfinedListener` says what to do, unless
`allow_wildcard_listen` acknowledges it (`--transfer-allow-wildcard-listen`, or a wildcard `--host`,
which asks for every interface anyway): then it starts with one warning naming its ports and the
firewall rule the deployment needs (deploy/README.md, "Security model"). Exposed there, without any
authentication: reads and writes of the buffers the engine registered (KV pages, metadata rows,
state), and the segment description the handshake hands out. nixl, the node's default backend, listens
on the given host only.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Sequence

import psutil

from transfer.engine import BackendUnavailable, TransferEngine, TransferError, host_addresses, poll_pause
from transfer.memory import HOST, is_device

logger = logging.getLogger(__name__)

_INSTALL_HINT = ("pip install mooncake-transfer-engine (CUDA hosts) or mooncake-transfer-engine-non-cuda "
                 "(CPU-only; needs Debian libibverbs1 libnl-3-200 libnl-route-3-200)")

_ENV_DEFAULTS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_TCP_ENABLE_CONNECTION_POOL": "1",
    "GLOG_minloglevel": "1",  # Mooncake logs every connection at INFO; keep warnings and errors
}
_STATUS = {-1: "failed", -2: "timed out (MC_TRANSFER_TIMEOUT)"}
NON_CUDA_PACKAGE = "mooncake-transfer-engine-non-cuda"


def cuda_build() -> bool:
    """Whether the installed Mooncake is its CUDA build (`mooncake-transfer-engine`), which tells device
    pointers from host ones itself; the CPU-only build would read a device address as host memory."""
    try:
        importlib.metadata.distribution(NON_CUDA_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        return False
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _listening() -> set[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def _cluster_subnet(host: str) -> str:
    """The IPv4 network of the interface holding `host` ("10.0.0.0/24"), for the firewall example."""
    wanted = host_addresses(host)
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and a.netmask and ipaddress.ip_address(a.address) in wanted:
                return str(ipaddress.ip_network(f"{a.address}/{a.netmask}", strict=False))
    return "CLUSTER_SUBNET"


class UnconfinedListener(TransferError):
    """The engine listens on a wildcard address although the node was given a specific host."""


def is_wildcard(ip: str) -> bool:
    """Whether a listening address is every interface's (0.0.0.0, ::)."""
    try:
        return ipaddress.ip_address(ip.split("%", 1)[0]).is_unspecified
    except ValueError:
        return False


def _where(opened: list[tuple[str, int]]) -> str:
    return ", ".join(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip, port in opened)


def refusal(host: str, opened: list[tuple[str, int]]) -> str:
    """Why a mooncake engine on a specific host is not started, and the two ways on."""
    wild = [lst for lst in opened if is_wildcard(lst[0])]
    return (f"mooncake would listen on all interfaces ({_where(wild)}) although --host is {host}: Mooncake "
            "cannot bind its handshake and TCP listeners to one address, and they serve reads and writes of "
            "the KV buffers to anyone who reaches them. Use --transfer-backend nixl (listens on --host "
            "only), or accept the exposure with --transfer-allow-wildcard-listen "
            "(PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN=1) and firewall those ports to the cluster's hosts "
            "(deploy/README.md, Security model)")


def exposure_warning(host: str, opened: list[tuple[str, int]]) -> str:
    """The start-up warning: mooncake's listeners, what they expose and the rule that confines them."""
    where = _where(opened)
    ports = ", ".join(str(port) for port in sorted({port for _, port in opened}))
    return (f"mooncake listens on all interfaces ({where}) whatever --host ({host}) says, and serves reads "
            "and writes of the KV buffers it registered to anyone who can reach those ports: firewall them "
            "to the cluster's hosts, e.g. `nft add rule inet filter input ip saddr != "
            f"{_cluster_subnet(host)} tcp dport {{ {ports} }} drop` (and the same for IPv6), or use "
            "--transfer-backend nixl (deploy/README.md, Security model)")


class MooncakeEngine(TransferEngine):
    name = "mooncake"

    def __init__(self, hostname: str = "127.0.0.1", device_name: str | None = None, protocol: str = "tcp",
                 allow_wildcard_listen: bool = False) -> None:
        super().__init__(hostname, device_name)
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            from mooncake.engine import TransferEngine as _MooncakeTE
        except ImportError as exc:
            raise BackendUnavailable(f"mooncake backend needs Mooncake: {_INSTALL_HINT} ({exc})") from exc
        self.protocol = protocol
        self._engine = _MooncakeTE()
        before = _listening()
        ret = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name or "")
        if ret != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, "
                                f"{device_name or ''!r}) failed with {ret}")
        rpc_port = self._engine.get_rpc_port()
        self.session_id = f"{hostname}:{rpc_port}"
        # nothing new in the table would be a surprise: count the handshake port as the wildcard it binds
        self.listeners = sorted(_listening() - before) or [("0.0.0.0", rpc_port)]
        if not any(is_wildcard(ip) for ip, _ in self.listeners):
            logger.info("mooncake listens on %s only (--host %s)", _where(self.listeners), hostname)
        elif allow_wildcard_listen or is_wildcard(hostname):
            logger.warning("%s", exposure_warning(hostname, self.listeners))
        else:
            self._engine = None  # the last reference: Mooncake's destructor closes both listeners
            left = sorted(_listening() & set(self.listeners))
            raise UnconfinedListener(refusal(hostname, self.listeners)
                                     + (f" (still open after the engine was dropped: {_where(left)})"
                                        if left else ""))
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def register(self, ptr: int, length: int, memory: str = HOST) -> None:
        if is_device(memory) and not cuda_build():
            raise BackendUnavailable(f"mooncake cannot register {memory} memory: the installed Mooncake is "
                                     f"its CPU-only build ({NON_CUDA_PACKAGE}); pip install "
                                     "mooncake-transfer-engine (its CUDA build) on GPU hosts")
        ret = self._engine.register_memory(ptr, length)
        if ret != 0:
            raise TransferError(f"Mooncake register_memory({ptr:#x}, {length}) failed with {ret}")
        with self._lock:
            self._registered.append((ptr, length))

    def describe(self) -> bytes:
        return self.session_id.encode()

    def add_peer(self, description: bytes) -> str:
        return description.decode()

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              src_memory: str = HOST, dst_memory: str = HOST) -> None:
        if not (len(src) == len(dst) == len(lengths)):
            raise TransferError("src, dst and lengths differ in length")
        if not src:
            return
        engine, problems, batches = self._engine, [], []
        for s, d, n in zip(src, dst, lengths, strict=True):
            batch = engine.batch_transfer_async_write(peer, [s], [d], [n])
            if batch <= 0:
                problems.append(f"could not be submitted ({batch})")
                break
            batches.append(batch)
        for batch in batches:  # wait for all, so that no write is still landing when this returns
            polls = 0
            while (status := engine.transfer_check_status(batch)) == 0:
                poll_pause(polls)
                polls += 1
            if status != 1:
                problems.append(_STATUS.get(status, f"failed with status {status}"))
        if problems:
            raise TransferError(f"Mooncake write of {len(src)} regions ({sum(lengths)} bytes) to {peer}: "
                                f"{problems[0]}")

    def close(self) -> None:
        with self._lock:
            regions, self._registered = self._registered, []
        for ptr, _ in regions:
            self._engine.unregister_memory(ptr)
