"""Hosts of their own on one machine: N network namespaces joined by a Linux bridge, each with one
address in 10.77.<net>.0/24 (the bridge, in the test's namespace, is 10.77.<net>.1, so the test reaches
every host). Names carry the test process's pid, so parallel runs cannot collide; `close()` removes every
namespace, veth and the bridge it made, whatever state the test left them in, and a new `Hosts` first
removes what a killed process (its pid no longer alive) left behind. `free_net()` finds a subnet no
bridge on this machine uses yet.

Faults on a host's link: `cut(i)` / `mend(i)` take its veth down and up (a partition: packets vanish,
no connection is reset), `drop(i, addr)` loses only host i's packets to one address (a partition between
two hosts), `shape(i, qdisc)` puts a `tc` qdisc on its link (`netem` delay and loss where the kernel has
it, `tbf` to cap the bandwidth), `lose(i, percent)` drops that share of its packets at random both ways
(nftables, for kernels without `netem`).
"""

from __future__ import annotations

import os
import re
import subprocess

SUBNET = "10.77"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def usable() -> str | None:
    """None when this process may make namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pdsprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _addrs_in_use() -> str:
    return _ip("-o", "-4", "addr", "show", check=False).stdout


def free_net(first: int = 20, last: int = 250) -> int:
    """The first `net` in first..last whose 10.77.`net`.0/24 no interface here has an address in."""
    used = _addrs_in_use()
    for net in range(first, last + 1):
        if f" {SUBNET}.{net}." not in used:
            return net
    raise RuntimeError(f"every subnet {SUBNET}.{first}..{last}.0/24 is in use")


def sweep_stale() -> list[str]:
    """Remove the namespaces, veths and bridges of runs whose process is gone (killed before `close()`);
    returns their names."""
    alive = {int(p) % 100000 for p in os.listdir("/proc") if p.isdigit()}
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, re.M)
    gone = []
    for kind, name in [("netns", x) for x in names] + [("link", x) for x in links]:
        m = re.fullmatch(r"pd[sbv](\d+)n\d+(h\d+)?", name)
        if m and int(m.group(1)) not in alive:
            _ip(kind, "del", name, check=False)
            gone.append(name)
    return gone


class Hosts:
    def __init__(self, n: int, net: int = 0) -> None:
        """n hosts in 10.77.`net`.0/24 (several sets at once: different `net`)."""
        sweep_stale()
        if f" {SUBNET}.{net}.1/" in _addrs_in_use():
            raise RuntimeError(f"subnet {SUBNET}.{net}.0/24 is already in use on this machine (see "
                               "free_net())")
        tag = f"{os.getpid() % 100000}n{net}"
        self.bridge = f"pdb{tag}"
        self.names = [f"pds{tag}h{i}" for i in range(n)]
        self.veths = [f"pdv{tag}h{i}" for i in range(n)]
        subnet = f"{SUBNET}.{net}"
        self.addrs = [f"{subnet}.{i + 2}" for i in range(n)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name, veth, addr in zip(self.names, self.veths, self.addrs, strict=True):
                _ip("netns", "add", name)
                _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "n")
                _ip("link", "set", veth + "n", "netns", name)
                _ip("link", "set", veth, "master", self.bridge, "up")
                self.run(name, "ip", "addr", "add", f"{addr}/24", "dev", veth + "n")
                self.run(name, "ip", "link", "set", veth + "n", "up")
                self.run(name, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def run(name: str, *cmd: str) -> str:
        return subprocess.run(["ip", "netns", "exec", name, *cmd], capture_output=True, text=True,
                              check=True).stdout

    def listeners(self, i: int) -> list[str]:
        """Local addresses of the TCP sockets listening in host i (`ss -ltnH`)."""
        return [line.split()[3]
                for line in self.run(self.names[i], "ss", "-ltnH").splitlines() if line.strip()]

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "down")

    def mend(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "up")

    def drop(self, i: int, dst: str | None, undo: bool = False) -> None:
        """Host i's packets to address `dst` vanish (`undo`: deliver them again): a partition between two
        hosts only, every other link unaffected. Done with a permanent neighbour entry naming a MAC no
        host owns, so it needs no packet classifier in the kernel."""
        dev, ns = self.veths[i] + "n", self.names[i]
        if undo:
            subprocess.run(["ip", "netns", "exec", ns, "ip", "neigh", "del", dst, "dev", dev],
                           capture_output=True)
        else:
            self.run(ns, "ip", "neigh", "replace", dst, "lladdr", "02:00:00:00:77:77", "dev",
                     dev, "nud", "permanent")

    def shape(self, i: int, qdisc: str | None) -> None:
        """A root qdisc on both ends of host i's link (e.g. "netem delay 20ms loss 1%", or "tbf rate
        20mbit burst 64kb latency 200ms" to cap its bandwidth); None removes it."""
        for dev, ns in ((self.veths[i], None), (self.veths[i] + "n", self.names[i])):
            prefix = ["ip", "netns", "exec", ns] if ns else []
            subprocess.run(prefix + ["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if qdisc:
                subprocess.run(prefix + ["tc", "qdisc", "add", "dev", dev, "root", *qdisc.split()],
                               capture_output=True, text=True, check=True)

    def lose(self, i: int, percent: float | None) -> None:
        """Drop `percent` % of host i's packets at random, sent and received (None: stop). A random-number
        rule in the host's own nftables, so it needs no `netem`; `can_lose()` says whether nft works."""
        ns = self.names[i]
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "pdloss"],
                       capture_output=True)
        if percent:
            # numgen gives 0..9999: drop below percent x 100
            rules = "\n".join(f"add chain inet pdloss {hook} {{ type filter hook {hook} priority 0; }}\n"
                              f"add rule inet pdloss {hook} numgen random mod 10000 < {round(percent * 100)} "
                              "counter drop"
                              for hook in ("input", "output"))
            subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                           input="add table inet pdloss\n" + rules,
                           capture_output=True, text=True, check=True)

    def lost(self, i: int) -> int:
        """Packets `lose` has dropped on host i so far (0 when it is not losing any)."""
        out = subprocess.run(["ip", "netns", "exec", self.names[i], "nft", "list", "table", "inet", "pdloss"],
                             capture_output=True, text=True).stdout
        return sum(int(w) for w in re.findall(r"counter packets (\d+)", out))

    def can_lose(self) -> bool:
        try:
            self.lose(0, 1.0)
        except (OSError, subprocess.CalledProcessError):
            return False
        self.lose(0, None)
        return True

    def has_qdisc(self, qdisc: str) -> bool:
        """Whether the kernel takes this qdisc (netem is a module some kernels lack)."""
        dev = self.veths[0]
        ok = subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", *qdisc.split()],
                            capture_output=True).returncode == 0
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return ok

    def close(self) -> None:
        for name in self.names:
            _ip("netns", "del", name, check=False)  # takes its veth end, and so the pair, with it
        for veth in self.veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)

    def left_behind(self) -> list[str]:
        """Namespaces or links of this run that still exist."""
        ns = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return [x for x in (*self.names, *self.veths, self.bridge) if x in ns
                or f" {x}:" in links or f" {x}@" in links]
