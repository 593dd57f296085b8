"""Small helpers of the launcher (deploy/process.py, deploy/nodes.py, deploy/cluster.py): free ports,
core lists, a fresh cluster secret file, and tiny HTTP probes.

Ports: `free_port()` picks a port that is free now and that this process never handed out before, so
two servers started side by side (the nodes of a cluster, the tests' servers) never draw the same one;
processes that start servers at the same time (pytest-xdist workers) each take a share of the numbers
(`set_port_share`)."""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import urllib.error
import urllib.request

from common.cores import parse_cores

ROLES = ("prefill", "decode", "router")

_given: set[int] = set()  # every port free_port handed out in this process
_share = (0, 1)  # (index, count): only ports with port % count == index


class ClusterError(RuntimeError):
    """A server or a cluster could not start; the message names the process and shows its log tail."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def set_port_share(index: int, count: int) -> None:
    """From now on `free_port` returns only ports `p` with `p % count == index % count`."""
    global _share
    _share = (index % max(count, 1), max(count, 1))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, chosen below the kernel's ephemeral range when possible (transfer
    engines and ZMQ bind ephemeral ports at start-up and could take a port picked from there), never
    one this process handed out before, and within this process's share."""
    rng = random.Random()
    low = _ephemeral_low()
    index, count = _share
    for attempt in range(200 * count):
        port = rng.randrange(20000, low) if low > 21000 and attempt < 150 * count else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _given and port % count == index:
            _given.add(port)
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


def http_status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of a GET (0: no answer)."""
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
