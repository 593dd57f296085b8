"""Nothing a local cluster starts listens where it was not asked to.

A cluster is started the way `pdserve cluster` starts one (`cluster_from_args`, its defaults, host
127.0.0.1; 1 prefill node with TP 2, so the TP ranks' rendezvous and gloo sockets exist, and 1 decode
node; tiny model; the router's metrics server on). Every process of its tree (router, node front
ends, scheduler ranks) is asked for its listening TCP sockets and unconnected UDP sockets: none may be
on a wildcard address (0.0.0.0, ::) or on any address but loopback. A second router started with no
address flags at all (as a user would type it) must also stay on loopback, metrics server included.
The ipc sockets between a front end and its ranks must sit in a directory only this user can enter,
and every child runs with the launch's cluster secret. With mooncake, which cannot be confined, each
node must log the start-up warning that names every port it opened on all interfaces.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from deploy.cluster import Cluster
from deploy.cluster_cli import cluster_from_args
from deploy.process import ROOT
from deploy.procs import free_port, http_status

MOONCAKE_WARNING = "mooncake listens on all interfaces"


@dataclass(frozen=True)
class Listener:
    child: str  # the cluster child whose process tree holds the socket ("prefill-0", "router", ...)
    pid: int
    kind: str  # "tcp" or "udp"
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.split("%", 1)[0]).is_loopback

    def __str__(self) -> str:
        return f"{self.child} pid {self.pid}: {self.kind} {self.ip}:{self.port}"


def start(model: str, log_dir: Path, *flags: str) -> Cluster:
    cluster = cluster_from_args(["--prefill", "1", "--decode", "1", "--model", model, "--port", "0",
                                 "--log-dir", str(log_dir), "--max-total-tokens",
                                 "2048", "--num-threads", "1", *flags])
    cluster.quiet, cluster.startup_timeout, cluster.grace_period = True, 600, 15
    return cluster.start()


def processes(cluster: Cluster) -> list[tuple[str, psutil.Process]]:
    out = []
    for c in cluster.children:
        root = psutil.Process(c.proc.pid)
        out += [(c.name, p) for p in (root, *root.children(recursive=True))]
    return out


def listeners(cluster: Cluster) -> list[Listener]:
    found = []
    for name, proc in processes(cluster):
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
                found.append(Listener(name, proc.pid, "tcp", c.laddr.ip, c.laddr.port))
            elif c.type == socket.SOCK_DGRAM and not c.raddr:
                found.append(Listener(name, proc.pid, "udp", c.laddr.ip, c.laddr.port))
    return found


def post_json(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def ask(cluster: Cluster) -> None:
    """One chat request through the router: the KV really moves between the nodes."""
    status, body = post_json(cluster.url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, (status, body)


def junk(found: list[Listener], size: int = 4096) -> None:
    """Random bytes to every listener: a TCP connection that writes `size` bytes and closes, a datagram."""
    rng = random.Random(13)
    for lst in found:
        data = rng.randbytes(size)
        family = socket.AF_INET6 if ":" in lst.ip else socket.AF_INET
        try:
            if lst.kind == "tcp":
                with socket.create_connection((lst.ip, lst.port), timeout=2) as s:
                    s.sendall(data)
            else:
                with socket.socket(family, socket.SOCK_DGRAM) as s:
                    s.sendto(data[:512], (lst.ip, lst.port))
        except OSError:
            pass  # a listener that hangs up on garbage is doing its job


def tree_listeners(pid: int) -> list[tuple[str, int]]:
    root = psutil.Process(pid)
    return [(c.laddr.ip, c.laddr.port) for p in (root, *root.children(recursive=True))
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN or not c.raddr]


def bare_router_listeners(cluster: Cluster, log_dir: Path) -> list[tuple[str, int]]:
    """Start `python -m router` with only ports and workers (no --host, no --prometheus-host), wait for
    its readiness, and return where it listens."""
    port, metrics = free_port(), free_port()
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    cmd = [sys.executable, "-m", "router", "--pd-disaggregation", "--port", str(port), "--prometheus-port",
           str(metrics), "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url]
    with open(log_dir / "bare-router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while http_status(f"http://127.0.0.1:{port}/readiness") != 200:
            assert proc.poll() is None and time.time() < deadline, (log_dir / "bare-router.log").read_text()
            time.sleep(0.25)
        found = tree_listeners(proc.pid)
        assert {port, metrics} <= {p for _, p in found}, found
        return found
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.backend("nixl")
def test_local_cluster_listens_on_loopback_only(tiny_model_dir, tmp_path):
    metrics = free_port()
    cluster = start(tiny_model_dir, tmp_path, "--prefill-args", "--tp 2",
                    "--router-args", f"--prometheus-port {metrics}")
    try:
        ask(cluster)
        found = listeners(cluster)
        outside = [str(lst) for lst in found if not lst.loopback]
        assert not outside, "listening beyond loopback (wildcard or another interface):\n" \
            + "\n".join(outside)

        # the scan saw what it had to: every HTTP and bootstrap port, and the TP ranks' own sockets
        ports = {lst.port for lst in found}
        assert metrics in ports, "the router's metrics server is not among the listeners"
        for c in cluster.children:
            assert c.port in ports, f"{c.name}'s HTTP port {c.port} is not among the listeners"
            if c.bootstrap_port:
                assert c.bootstrap_port in ports, f"{c.name}'s bootstrap port is not among the listeners"
        prefill = cluster.prefills[0]
        rank_pids = {lst.pid for lst in found if lst.child == prefill.name and lst.pid != prefill.proc.pid}
        assert len(rank_pids) \
            >= 2, f"expected listeners (gloo, control plane, engine) in both TP ranks: {found}"

        # front end <-> scheduler ipc sockets: in a directory no other user can enter
        for node in cluster.prefills + cluster.decodes:
            paths = [c.laddr for c in psutil.Process(node.proc.pid).net_connections(kind="unix")
                     if isinstance(c.laddr, str) and c.laddr.startswith("/")]
            assert paths, f"{node.name}: no ipc socket found"
            for path in paths:
                st = os.stat(os.path.dirname(path))
                assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0, \
                    f"{node.name}: {path} is in a directory with mode {stat.S_IMODE(st.st_mode):o}"

        # loopback is shared with the machine's other users: the launch gave every child its own secret
        assert stat.S_IMODE(os.stat(cluster.cluster_secret_file).st_mode) == 0o600
        for c in cluster.children:
            assert "no cluster secret" not in Path(c.log_path).read_text(errors="replace"), c.name

        # an attacker on the host sends a few kilobytes of random bytes to every port: the cluster serves on
        junk(found)
        ask(cluster)
        assert all(c.proc.poll() is None for c in cluster.children), "a child died of random bytes"

        bare = bare_router_listeners(cluster, tmp_path)
        assert all(ipaddress.ip_address(ip).is_loopback
                   for ip, _ in bare), f"router defaults listen on {bare}"
    finally:
        cluster.stop()


@pytest.mark.backend("mooncake")
def test_mooncake_warns_about_every_port_it_opens_on_all_interfaces(tiny_model_dir, tmp_path):
    cluster = start(tiny_model_dir, tmp_path, "--transfer-backend", "mooncake")
    try:
        ask(cluster)
        outside = [lst for lst in listeners(cluster) if not lst.loopback]
        assert outside, "mooncake is known to listen on all interfaces; the scan found nothing"
        for node in cluster.prefills + cluster.decodes:
            warnings = [line for line in Path(node.log_path).read_text(errors="replace").splitlines()
                        if MOONCAKE_WARNING in line]
            assert len(warnings) == 1, f"{node.name}: expected one start-up warning, got {warnings}"
            assert "firewall" in warnings[0] and "nft add rule" in warnings[0]
            named = {int(p) for p in re.findall(r":(\d+)[,)]", warnings[0].split(" whatever ")[0])}
            mine = {lst.port for lst in outside if lst.child == node.name}
            assert mine \
                and mine <= named, f"{node.name}: listens on {mine} beyond loopback, warning names {named}"
        assert {lst.child for lst in outside} <= {c.name for c in cluster.prefills + cluster.decodes}, outside
    finally:
        cluster.stop()
