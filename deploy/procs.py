"""Process, port and secret helpers of the cluster launcher (`deploy/cluster.py`): free ports, core
lists, a fresh cluster secret file, a child that dies with its parent, and tiny HTTP probes."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import urllib.error
import urllib.request

from common.cores import parse_cores

ROLES = ("prefill", "decode", "router")


class ClusterError(RuntimeError):
    """The cluster could not start; the message names the child and shows its log tail."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", avoid: set[int] | None = None) -> int:
    """A port that is free now, chosen below the kernel's ephemeral range when possible: transfer
    engines and ZMQ bind ephemeral ports at start-up and could take a port we picked from there."""
    rng = random.Random()
    low = _ephemeral_low()
    for attempt in range(200):
        port = rng.randrange(20000, low) if low > 21000 and attempt < 150 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if avoid is None or port not in avoid:
            if avoid is not None:
                avoid.add(port)
            return port
    raise ClusterError("no free TCP port found")


def new_secret_file(path: str) -> str:
    """Write a new random cluster secret to `path` (mode 0600, replacing an older one); returns `path`."""
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def parse_affinity(spec: str | None) -> dict[str, list[int]]:
    """"prefill=0;decode=1-3" -> {"prefill": [0], "decode": [1, 2, 3]}; cores must exist here."""
    if not spec:
        return {}
    out: dict[str, list[int]] = {}
    available = sorted(os.sched_getaffinity(0))
    for item in spec.replace(" ", "").split(";"):
        if not item:
            continue
        role, sep, cores = item.partition("=")
        if not sep or role not in ROLES:
            raise ValueError(f"--cpu-affinity: expected ROLE=CORES with ROLE in {ROLES}, got {item!r}")
        try:
            out[role] = parse_cores(cores)
        except ValueError as e:
            raise ValueError(f"--cpu-affinity {role}: {e}") from None
        missing = [c for c in out[role] if c not in available]
        if missing:
            raise ValueError(f"--cpu-affinity {role}: cores {missing} are not available (have {available})")
    return out


def die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies, so a launcher killed hard leaves no orphans."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return 0


def http_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())
