"""`pdserve cluster`: a whole PD cluster on this machine with one command.

    pdserve cluster --prefill 2 --decode 2 --transfer-backend fake --model DIR --port 30000

starts N prefill nodes and M decode nodes (`python -m prefill_node` / `python -m decode_node`, each on
127.0.0.1 with a free HTTP port, every prefill node with its own free bootstrap port), waits until
every node answers `/health`, then starts the router (`python -m router --pd-disaggregation ...`) on
`--port` and waits until `/readiness` says all workers are up. It prints the router URL and a curl
example, then watches its children until Ctrl-C / SIGTERM, which it forwards as a clean shutdown
(SIGTERM to each child, SIGKILL of the child's process group after `--grace-period`).

Each child runs in its own session (process group) with its stdout+stderr in `<log-dir>/<name>.log`
(`--log-dir`, default `./logs/cluster-<timestamp>`); `<log-dir>/cluster.json` lists every child's
command, ports and pid. A child that dies during start-up stops the launch with an error naming it
and the tail of its log.

By default (`--cpu-affinity auto`) every node gets cores of its own and as many torch threads, so the
prefill and decode nodes do not fight over cores (deploy/placement.py says how it splits them); the
launcher prints what it chose. Decode node i also borrows prefill node i's cores while that node has
nothing to run (common/core_loan.py; `--no-core-loan`: never). `--cpu-affinity "prefill=0;decode=1"` pins every process of a role to
those cores instead (`0-3,6` lists work; `router=` is accepted too), `--cpu-affinity none` pins
nothing. A pinned process's scheduler processes inherit the mask, and a node's torch threads default
to the cores it may run on divided by its TP size. `--device cuda` (or auto on a machine with GPUs) also
places the nodes on the GPUs of `--gpu-ids`, a GPU set of its own per node or, with fewer GPUs,
shared with `--mem-fraction-static` shares, and prints what it chose (deploy/gpu_placement.py).
Flags that are not the launcher's own
are passed to every node unchanged (checked against the node parser first); `--router-args "..."`
adds router flags.

By default the cluster also disaggregates conditionally (`--local-prefill-queue 3`): while the prefill
node already has three of the router's prefills in flight, the router sends the next request to a decode
node alone, which prefills it itself in chunks of 64 tokens, its running requests decoding a token inside
each chunk's forward (`--enable-mixed-chunk`; a second such request while the first waits for its first
token only when the prefill node has six in flight, and so on). On few cores the prefill node is the bottleneck and the decode
node's steps are bound by streaming the weights, so its spare batch slots are cheaper than a queue;
`pdserve bench placement` measures the cluster with it and without it (`--local-prefill-queue 0`).

`--hosts` puts the router and every node on a host of its own: a network namespace with its own address
(deploy/netns.py, 10.77.N.0/24 on a bridge; needs root), as on separate machines; the namespaces go with
the cluster.

`Cluster` is the same launcher as a library (the integration tests and `pdserve bench compare` use it).

Everything listens on `--host` (127.0.0.1 by default) and nowhere else: node HTTP, bootstrap servers,
ZMQ control planes, the router and its metrics server, and the transfer engines. That is why the
default backend is nixl: it can be confined to the host's interface, while mooncake listens on every
interface and serves this process's memory to whoever reaches it (it warns at start-up; see
deploy/README.md, "Security model"). Loopback is shared by every user of the machine, so each launch
also gives its children a cluster secret (`$PDSERVE_CLUSTER_SECRET_FILE`): the file named by
`--cluster-secret-file` or that variable, else a fresh random one in `<log-dir>/cluster-secret` (mode
0600), which authenticates the bootstrap and control-plane traffic between the nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from common import core_loan
from common.models.hub import is_hub_id
from deploy.gpu_placement import GpuPlan, plan_from_flags
from deploy.placement import Placement, plan
from deploy.procs import (
    ClusterError,
    die_with_parent,
    free_port,
    http_status,
    new_secret_file,
    parse_affinity,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEALTH_DEFAULTS = (("--health-check-interval-secs", "2"), ("--health-failure-threshold", "2"),
                   ("--health-success-threshold", "2"))
SECRET_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
# the chunk a decode node prefills a local request in: a core computes 64 tokens of SmolLM2-135M in ~0.2 s,
# so the running batch's tokens never wait much longer (single runs of `bench placement`'s workload: an ITL
# p99 of 672 ms with chunks of 128, 424-501 ms with 64)
LOCAL_PREFILL_CHUNK = 64
# prefills in flight on the prefill node before a decode node takes one itself (2N before a second, ...).
# With 8 requests always in flight (`bench placement`) a higher N gives a little more throughput: 4 beat 3
# in four alternating rounds (51.0 / 51.3 / 52.8 / 50.7 against 49.0 / 46.6 / 50.2 / 46.8 tok/s), and 4 against
# 2 five rounds each in the same hour gave 0.985 against 0.968 of one node. Under a Poisson stream with
# latency SLOs (`bench compare --cluster default`) 2 keeps 90 % of requests within TTFT 2 s / TPOT 100 ms up
# to 1.10-1.43 req/s, 4 only to 0.64-0.78: at 4 the one prefill core queues past the TTFT SLO while the
# decode node's TPOT has room. 1 sends too much to the decode node (20 of 42 requests local; 0.80 of one
# node). 3 (one local prompt at a time when 3+ wait at the prefill node, a second at 6+, never a third with
# 8 in flight) read best on both (2026-11-29): with 8 in flight 1.10, 1.05 and 0.99 of one node (medians
# of five rounds; 1.05, 0.99 and 1.01 by mean throughput) where 2 had read 0.97-1.00 in four runs (0.98 by means),
# and under the Poisson stream, three rounds pooled, 90 % within both SLOs up to 1.05 req/s against the
# colocated node's 0.60 (`slo_rate` 1.75; each round 1.60-2.07). The gain is within one run's spread.
DEFAULT_LOCAL_PREFILL_QUEUE = 3


def _has_flag(flags: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in flags)


@dataclass
class Child:
    name: str  # "prefill-0", "decode-1", "router"
    role: str
    cmd: list[str]
    port: int
    log_path: str
    bootstrap_port: int | None = None
    cores: list[int] | None = None
    host: str = "127.0.0.1"  # the address it listens on
    netns: str | None = None  # its network namespace (--hosts)
    proc: subprocess.Popen | None = None
    exit_reported: bool = False
    port_retries: int = 0
    # supervision (`Cluster.supervise`): restart times, the next back-off, a pending restart, health
    restarts: list[float] = field(default_factory=list)
    backoff: float = 0.0
    restart_at: float | None = None
    started_at: float = 0.0
    healthy_since: float | None = None
    awaiting_health: bool = False
    gave_up: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def describe(self) -> dict:
        return {"name": self.name, "role": self.role, "url": self.url, "port": self.port,
                "bootstrap_port": self.bootstrap_port, "cores": self.cores, "log": self.log_path, "netns": self.netns,
                "pid": self.proc.pid if self.proc else None, "cmd": self.cmd}


@dataclass
class Cluster:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "default"
    transfer_backend: str = "nixl"  # confinable to `host` (mooncake is not)
    port: int | None = None  # router port; None: a free one
    host: str = "127.0.0.1"  # address everything binds to
    # every process on a host of its own: a network namespace with its own address (deploy/netns.py)
    hosts: bool = False
    log_dir: str | None = None
    cpu_affinity: dict[str, list[int]] = field(default_factory=dict)  # cores per role, given
    auto_placement: bool = False  # cores per node chosen by deploy.placement (overrides cpu_affinity)
    cores: list[int] | None = None  # the cores auto_placement divides (None: all this process may run on)
    # with auto_placement: decode node i borrows prefill node i's cores while it idles (common/core_loan.py)
    core_loan: bool = True
    node_args: list[str] = field(default_factory=list)  # extra ServerArgs flags for every node
    gpu_plan: GpuPlan | None = None  # --device / GPUs per node (deploy/gpu_placement.py); None: the nodes' default
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    # conditional disaggregation: the router's --local-prefill-queue (0: off), and the decode nodes take
    # requests without a rendezvous, prefilled LOCAL_PREFILL_CHUNK tokens at a time, mixed with decode rows
    local_prefill_queue: int = 0
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every child
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per role: {"prefill": {...}}
    startup_timeout: float = 600.0
    grace_period: float = 20.0
    quiet: bool = False
    # file with the secret every child gets; None: $PDSERVE_CLUSTER_SECRET_FILE, else a new one in log_dir
    cluster_secret_file: str | None = None
    # restarts of a child that exits after start-up (`supervise`); at most `max_restarts` per child
    # within `restart_window` seconds, after a back-off from `backoff_initial` doubling to `backoff_max`
    restart: bool = False
    max_restarts: int = 5
    restart_window: float = 600.0
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    children: list[Child] = field(default_factory=list, init=False)
    # (wall time, child name, event, detail): exited, restarting, restarted, healthy, gave_up
    events: list[tuple[float, str, str, str]] = field(default_factory=list, init=False)

    # ------------------------------------------------------------------------------------ layout
    @property
    def prefills(self) -> list[Child]:
        return [c for c in self.children if c.role == "prefill"]

    @property
    def decodes(self) -> list[Child]:
        return [c for c in self.children if c.role == "decode"]

    @property
    def router(self) -> Child:
        for c in self.children:
            if c.role == "router":
                return c
        raise ClusterError("the cluster has no router (not started)")

    @property
    def url(self) -> str:
        return self.router.url

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    def _node_cmd(self, role: str, port: int, bootstrap_port: int, host: str | None = None,
                  name: str | None = None) -> list[str]:
        module = "prefill_node" if role == "prefill" else "decode_node"
        cmd = [sys.executable, "-m", module, "--model", self.model, "--host", host or self.host, "--port", str(port),
               "--transfer-backend", self.transfer_backend]
        if role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        elif self.local_prefill_queue > 0:  # before the given flags, so a given chunk size wins
            cmd += ["--disaggregation-local-prefill", "--chunked-prefill-size", str(LOCAL_PREFILL_CHUNK)]
            if not _has_flag(self.node_args + self.decode_args, "--speculative-algorithm"):  # (they exclude each other)
                cmd.append("--enable-mixed-chunk")
        cmd += self.gpu_plan.node_flags(name) if self.gpu_plan else []
        return cmd + self.node_args + (self.prefill_args if role == "prefill" else self.decode_args)

    def _no_core_loan(self) -> str | None:
        """Why the decode nodes cannot borrow their prefill node's cores (None: they can)."""
        if not self.core_loan:
            return "turned off"
        parser = node_parser()
        for role, flags in (("prefill", self.node_args + self.prefill_args), ("decode", self.node_args + self.decode_args)):
            ns, _ = parser.parse_known_args(flags)
            if ns.core_loan_file or ns.core_loan_cores:
                return f"the {role} flags set the core loan themselves"
            why = core_loan.unsupported(role, ns.tp, ns.pp_size, ns.dp_size, ns.enable_overlap_schedule)
            if why:
                return f"the {role} nodes' flags: {why}"
        return None

    def _loan_args(self, name: str) -> list[str]:
        """The core-loan flags of node `name`: the lender and its borrower share a file in the log directory."""
        loans = self.placement.loans
        lender = loans.get(name, name if name in loans.values() else None)
        if lender is None:
            return []
        path = os.path.join(self.log_dir, f"core-loan-{lender}")
        if name == lender:  # prefill nodes come first
            core_loan.open_loan_file(path).close()  # mode 0600; the lender writes BUSY when it starts
            return ["--core-loan-file", path]
        return ["--core-loan-file", path, "--core-loan-cores", ",".join(map(str, self.placement.cores[lender]))]

    def _router_cmd(self, port: int, host: str | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "router", "--pd-disaggregation", "--host", host or self.host, "--port", str(port)]
        for p in self.prefills:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in self.decodes:
            cmd += ["--decode", d.url]
        if not any(a.startswith("--prometheus-port") for a in self.router_args):
            cmd += ["--prometheus-port", "0"]  # /metrics is on the router's own port too
        # a node that dies leaves the rotation within ~4 s and a restarted one is back ~4 s after its
        # /health passes (sglang-router's defaults, 60 s x 3, would keep a dead node in for 3 minutes)
        if self.local_prefill_queue > 0 and not _has_flag(self.router_args, "--local-prefill-queue"):
            cmd += ["--local-prefill-queue", str(self.local_prefill_queue)]
        for flag, value in HEALTH_DEFAULTS:
            if not _has_flag(self.router_args, flag):
                cmd += [flag, value]
        return cmd + self.router_args

    # ------------------------------------------------------------------------------------ processes
    def _spawn(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", SECRET_ENV: self.cluster_secret_file, **self.env,
               **(self.placement.node_env(child.name) if child.role != "router" else {}), **self.role_env.get(child.role, {})}
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cores = child.cores

        def pin() -> None:  # runs in the child between fork and exec
            die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        cmd = (["ip", "netns", "exec", child.netns] if child.netns else []) + child.cmd
        with open(child.log_path, "ab") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            child.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=pin)
        child.exit_reported = False
        child.started_at = time.time()
        child.healthy_since = None
        if not child.backoff:
            child.backoff = self.backoff_initial

    def _respawn_on_new_ports(self, c: Child) -> bool:
        """A node that lost a port race (another process bound the port we picked for it before it
        did) gets new ports and is started again, at most 3 times."""
        if c.port_retries >= 3 or "address already in use" not in c.log_tail(60).lower():
            return False
        if c.role == "router" and self.port:
            return False  # the port the user asked for: report it
        c.port_retries += 1
        used = {x.port for x in self.children} | {x.bootstrap_port for x in self.children if x.bootstrap_port}
        c.port = free_port(self.host, used)
        if c.role == "prefill":
            c.bootstrap_port = free_port(self.host, used)
        c.cmd = self._router_cmd(c.port, c.host) if c.role == "router" else \
            self._node_cmd(c.role, c.port, c.bootstrap_port or 0, c.host, c.name)
        self._say(f"  {c.name}: a port was taken while it started; retrying on port {c.port}")
        self._spawn(c)
        self.write_manifest()
        return True

    def _wait_healthy(self, children: list[Child], path: str, deadline: float) -> None:
        pending = list(children)
        while pending:
            for c in list(pending):
                if not c.alive() and self._respawn_on_new_ports(c):
                    continue
                if not c.alive():
                    raise ClusterError(f"{c.name} exited with code {c.proc.returncode} during start-up "
                                       f"(log {c.log_path}):\n{c.log_tail()}")
                if http_status(c.url + path) == 200:
                    pending.remove(c)
                    self._say(f"  {c.name} ready at {c.url}")
            if not pending:
                return
            if time.time() > deadline:
                names = ", ".join(c.name for c in pending)
                tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.log_tail(15)}" for c in pending)
                raise ClusterError(f"not healthy after {self.startup_timeout:.0f}s: {names}\n{tails}")
            time.sleep(0.25)

    def __post_init__(self) -> None:
        self._stopping = False
        self._supervisor: threading.Thread | None = None
        self.net = None  # with --hosts, a deploy.netns.Hosts: host 0 is the router, then the nodes
        self.placement = Placement()  # the automatic placement, once started with auto_placement

    def start(self) -> Cluster:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ClusterError("a PD cluster needs at least one prefill and one decode node")
        if self.log_dir is None:
            self.log_dir = os.path.join(os.getcwd(), "logs", time.strftime("cluster-%Y%m%d-%H%M%S"))
        os.makedirs(self.log_dir, exist_ok=True)
        self.cluster_secret_file = self.cluster_secret_file or os.environ.get(SECRET_ENV) or \
            new_secret_file(os.path.join(self.log_dir, "cluster-secret"))
        used: set[int] = set()
        router_port = self.port or free_port(self.host, used)
        used.add(router_port)
        self.children = []
        places = self._places()
        if self.auto_placement:
            why_not = self._no_core_loan()
            self.placement = plan(self.num_prefill, self.num_decode, sorted(self.cores or os.sched_getaffinity(0)),
                                  loans=why_not is None)
            self._say(self.placement.describe() + (f" (no core loan: {why_not})" if why_not else ""))
        if self.gpu_plan and self.gpu_plan.describe():
            self._say(self.gpu_plan.describe())
        if self.local_prefill_queue > 0:
            self._say(f"conditional disaggregation: a decode node prefills a request itself while its prefill node "
                      f"has {self.local_prefill_queue}+ prefills in flight ({2 * self.local_prefill_queue}+ for a second), in chunks of {LOCAL_PREFILL_CHUNK} tokens "
                      "its running requests decode in (--local-prefill-queue 0: off)")
        for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for i in range(n):
                port = free_port(self.host, used)
                bport = free_port(self.host, used) if role == "prefill" else None
                name = f"{role}-{i}"
                cores = self.placement.cores[name] if self.auto_placement else self.cpu_affinity.get(role)
                host, netns = places[len(self.children) + 1]
                self.children.append(Child(name, role, self._node_cmd(role, port, bport or 0, host, name) +
                                           self._loan_args(name), port,
                                           os.path.join(self.log_dir, f"{name}.log"), bport, cores, host, netns))
        self._say(f"starting {self.num_prefill} prefill + {self.num_decode} decode nodes "
                  f"({self.transfer_backend} backend, model {self.model}); logs in {self.log_dir}")
        deadline = time.time() + self.startup_timeout
        try:
            for c in self.children:
                self._spawn(c)
            self.write_manifest()
            self._wait_healthy(list(self.children), "/health", deadline)
            rcores = self.cpu_affinity.get("router")
            router = Child("router", "router", [], router_port, os.path.join(self.log_dir, "router.log"),
                           cores=rcores, host=places[0][0], netns=places[0][1])
            self.children.append(router)
            router.cmd = self._router_cmd(router_port, router.host)
            self._spawn(router)
            self._wait_healthy([router], "/readiness", deadline)
        except BaseException:
            self.stop()
            raise
        self.write_manifest()
        return self

    def _places(self) -> list[tuple[str, str | None]]:
        """(address, network namespace) of the router, then of each node: all on --host, or with --hosts
        each in a namespace of its own (made now, removed by `stop`)."""
        n = 1 + self.num_prefill + self.num_decode
        if not self.hosts:
            return [(self.host, None)] * n
        from deploy.netns import Hosts, free_net, usable

        why = usable()
        if why is not None:
            raise ClusterError(f"--hosts: {why}")
        self.net = Hosts(n, net=free_net())
        self._say(f"hosts: router {self.net.addrs[0]} ({self.net.names[0]}), nodes "
                  f"{', '.join(self.net.addrs[1:])}, on bridge {self.net.bridge}")
        return list(zip(self.net.addrs, self.net.names, strict=True))

    def write_manifest(self) -> None:
        routers = [c for c in self.children if c.role == "router"]
        with open(os.path.join(self.log_dir, "cluster.json"), "w") as f:
            json.dump({"router": routers[0].url if routers else None, "transfer_backend": self.transfer_backend, "model": self.model,
                       "children": [c.describe() for c in self.children]}, f, indent=2)

    def _signal_child(self, c: Child, sig: int) -> None:
        if c.proc is None:
            return
        try:
            if sig == signal.SIGKILL:
                os.killpg(c.proc.pid, sig)  # the whole group: scheduler processes too
            elif c.proc.poll() is None:
                c.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_children(self, children: list[Child], grace: float | None = None) -> None:
        """SIGTERM each, wait up to `grace` seconds for all, then SIGKILL each process group."""
        grace = self.grace_period if grace is None else grace
        for c in children:
            self._signal_child(c, signal.SIGTERM)
        deadline = time.time() + grace
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._say(f"  {c.name} did not stop within {grace:.0f}s: killing it")
            self._signal_child(c, signal.SIGKILL)  # leftovers of the group (a crashed node's schedulers)
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------------------------ supervision
    def _event(self, c: Child, kind: str, detail: str) -> None:
        self.events.append((time.time(), c.name, kind, detail))
        self._say(f"{time.strftime('%H:%M:%S')} {c.name}: {detail}")

    def _group_gone(self, c: Child, timeout: float = 10.0) -> None:
        """SIGKILL what is left of a dead child's process group (its scheduler ranks hold its ports)
        and wait until the group is empty."""
        self._signal_child(c, signal.SIGKILL)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                os.killpg(c.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def supervise(self, now: float | None = None) -> None:
        """One pass over the children: a child that exited after start-up is restarted on the same
        ports and command after its back-off (`restart`), at most `max_restarts` times within
        `restart_window` seconds; a restarted child is reported healthy once its health URL answers.
        One line per event (`events`, and printed unless `quiet`)."""
        if self._stopping:
            return
        now = time.time() if now is None else now
        for c in list(self.children):
            if c.proc is None or c.gave_up:
                continue
            if c.alive():
                if c.awaiting_health and http_status(c.url + ("/readiness" if c.role == "router" else "/health"),
                                                     timeout=0.5) == 200:
                    c.awaiting_health = False
                    c.healthy_since = now
                    self._event(c, "healthy", f"healthy again on port {c.port} (pid {c.proc.pid}), "
                                              f"{now - c.started_at:.1f}s after its restart")
                if c.healthy_since is not None and now - c.healthy_since > 60.0:
                    c.backoff = self.backoff_initial  # a minute of health: the next crash restarts fast
                continue
            if c.restart_at is None:  # just seen dead
                if c.exit_reported:
                    continue
                c.exit_reported = True
                code = c.proc.returncode
                self._group_gone(c)
                recent = [t for t in c.restarts if now - t < self.restart_window]
                if not self.restart:
                    self._event(c, "exited", f"exited with code {code} (restarts are off); log {c.log_path}")
                    c.gave_up = True
                elif len(recent) >= self.max_restarts:
                    self._event(c, "gave_up", f"exited with code {code}; not restarted: {len(recent)} restarts in "
                                              f"the last {self.restart_window:.0f}s (--max-restarts "
                                              f"{self.max_restarts}); log {c.log_path}")
                    c.gave_up = True
                else:
                    c.restart_at = now + c.backoff
                    self._event(c, "exited", f"exited with code {code}; restart {len(recent) + 1}/"
                                             f"{self.max_restarts} in {c.backoff:.0f}s on port {c.port}")
                    c.backoff = min(c.backoff * 2, self.backoff_max)
            elif now >= c.restart_at:
                c.restart_at = None
                c.restarts.append(now)
                self._spawn(c)
                c.awaiting_health = True
                self.write_manifest()
                self._event(c, "restarted", f"restarted on port {c.port} (pid {c.proc.pid})")

    def start_supervisor(self, interval: float = 0.5) -> None:
        """`supervise()` every `interval` seconds on a daemon thread until `stop()`."""
        def loop() -> None:
            while not self._stopping:
                try:
                    self.supervise()
                except Exception as e:  # keep supervising whatever one pass raised
                    self._say(f"supervisor pass failed: {type(e).__name__}: {e}")
                time.sleep(interval)

        self._supervisor = threading.Thread(target=loop, name="cluster-supervisor", daemon=True)
        self._supervisor.start()

    def stop(self) -> None:
        """Router first (no new traffic), then every node; no restart from here on."""
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.join(timeout=30)
        routers = [c for c in self.children if c.role == "router"]
        self.stop_children(routers)
        self.stop_children([c for c in self.children if c.role != "router"])
        if self.net is not None:
            self.net.close()
            self.net = None

    def kill(self, name: str) -> None:
        """SIGKILL a child and its whole process group (a crash, for failure tests)."""
        c = self.child(name)
        self._signal_child(c, signal.SIGKILL)
        if c.proc is not None:
            c.proc.wait(10)
        c.exit_reported = True

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve cluster", description="start prefill and decode nodes and a PD router on this machine",
        epilog="Other flags are node flags (see `pdserve serve --help`) passed to every node.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--prefill", type=int, default=1, help="number of prefill nodes")
    a("--decode", type=int, default=1, help="number of decode nodes")
    a("--transfer-backend", "--disaggregation-transfer-backend", dest="transfer_backend", default="nixl",
      choices=("mooncake", "nixl", "ucx", "fake"),
      help="KV transfer engine (default nixl, which listens only on --host; mooncake listens on every interface)")
    a("--model", "--model-path", dest="model", default="default",
      help="model directory, Hugging Face Hub id (owner/name; add --revision R for a branch, tag or commit), "
           ".gguf file or 'default'")
    a("--port", type=int, default=30000, help="router port (0: a free one)")
    a("--host", default="127.0.0.1", help="address every process binds to")
    a("--hosts", action="store_true", help="each process on a host of its own: a network namespace with its own "
      "address in 10.77.N.0/24 on a bridge, as on separate machines (needs root; removed on exit)")
    a("--device", default=None, choices=("auto", "cpu", "cuda"), help="where the nodes run (default: their own "
      "default, auto). cuda, or auto where torch sees a GPU: each node on GPUs of its own from --gpu-ids, or "
      "sharing them with --mem-fraction-static shares when there are fewer (deploy/gpu_placement.py)")
    a("--gpu-ids", default=None, metavar="IDS", help="with --device cuda/auto: the GPUs the nodes may use, e.g. "
      "0,1,2,3, as torch numbers them (after CUDA_VISIBLE_DEVICES); default: every GPU torch sees")
    a("--tp", type=int, default=None, help="tensor parallel size of every node")
    a("--page-size", type=int, default=None, help="KV page size of every node (default: the node's)")
    a("--chunked-prefill-size", type=int, default=None,
      help="chunked prefill size of every node (default: the node's)")
    a("--cpu-affinity", default="auto", metavar="SPEC",
      help='"auto": cores of its own for every node, as many torch threads (shared round-robin, one thread '
           'each, when there are fewer cores than nodes); "none": no pinning; or pin roles to cores, e.g. '
           '"prefill=0;decode=1" or "prefill=0-1;decode=2-3;router=0"')
    a("--no-core-loan", action="store_true",
      help="with --cpu-affinity auto: decode node i does not borrow prefill node i's cores while that node has "
           "nothing to run (by default it does: common/core_loan.py)")
    a("--local-prefill-queue", type=int, default=DEFAULT_LOCAL_PREFILL_QUEUE, metavar="N",
      help="conditional disaggregation: the router sends a request to a decode node alone, to prefill it there "
      f"in chunks of {LOCAL_PREFILL_CHUNK} tokens between decode steps, while its prefill node has N or more "
      "prefills in flight per request the decode node is already prefilling itself, plus one (0: off, every "
      "prompt is prefilled on a prefill node). Decode nodes get --disaggregation-local-prefill, "
      f"--chunked-prefill-size {LOCAL_PREFILL_CHUNK} (given node flags win) and, unless they speculate, "
      "--enable-mixed-chunk (the running requests decode inside each chunk's forward); the router "
      "--local-prefill-queue N")
    a("--policy", default=None, help="router policy (random, round_robin, cache_aware, power_of_two)")
    a("--router-args", default="", help='more router flags, one string: --router-args="--policy random"')
    a("--prefill-args", default="", help='more flags for prefill nodes only: --prefill-args="--tp 2"')
    a("--decode-args", default="", help='more flags for decode nodes only: --decode-args="--max-running-requests 8"')
    a("--log-dir", default=None, help="folder for the children's logs (default ./logs/cluster-<timestamp>)")
    a("--cluster-secret-file", default=None, help="cluster secret every child uses (default: "
      f"${SECRET_ENV}, else a new random one in <log-dir>/cluster-secret)")
    a("--startup-timeout", type=float, default=900.0, help="seconds for every child to become healthy")
    a("--grace-period", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL at shutdown")
    a("--max-restarts", type=int, default=5, metavar="N",
      help="restart a child that exits after start-up, on the same ports, at most N times per child within "
           "--restart-window (back-off 1s doubling to 30s); 0: never restart (default 5)")
    a("--restart-window", type=float, default=600.0, metavar="SECS",
      help="the window --max-restarts counts restarts in (default 600)")
    return p


def node_parser() -> argparse.ArgumentParser:
    """The nodes' flag parser (ServerArgs), to check or read the flags the launcher passes on."""
    from common.config import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def check_node_flags(flags: list[str]) -> None:
    """Raise ValueError if a flag is not a node flag (the node would exit at start-up otherwise)."""
    try:
        _, unknown = node_parser().parse_known_args(flags)
    except SystemExit:
        raise ValueError(f"invalid node flags: {shlex.join(flags)}") from None
    if unknown:
        raise ValueError(f"not node flags: {' '.join(unknown)} (see `pdserve serve --help`)")


def check_router_flags(flags: list[str]) -> None:
    from router.cli import build_parser as router_parser

    try:
        _, unknown = router_parser().parse_known_args(flags)
    except SystemExit:
        raise ValueError(f"invalid router flags: {shlex.join(flags)}") from None
    if unknown:
        raise ValueError(f"not router flags: {' '.join(unknown)} (see `pdserve router --help`)")


def cluster_from_args(argv: list[str]) -> Cluster:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    node_args = list(extra)
    for flag, value in (("--tp", ns.tp), ("--page-size", ns.page_size),
                        ("--chunked-prefill-size", ns.chunked_prefill_size)):
        if value is not None:
            node_args += [flag, str(value)]
    prefill_args, decode_args = shlex.split(ns.prefill_args), shlex.split(ns.decode_args)
    router_args = shlex.split(ns.router_args)
    if ns.policy:
        router_args += ["--policy", ns.policy]
    try:
        for flags in (node_args, prefill_args, decode_args):
            check_node_flags(flags)
        check_router_flags(router_args)
        if ns.local_prefill_queue < 0:
            raise ValueError(f"--local-prefill-queue must be >= 0 (0: off), got {ns.local_prefill_queue}")
        affinity = {} if ns.cpu_affinity in ("auto", "none") else parse_affinity(ns.cpu_affinity)
        gpu_plan = plan_from_flags(ns.device, ns.gpu_ids, ns.prefill, ns.decode, node_args, prefill_args,
                                   decode_args, node_parser())
    except ValueError as e:
        parser.error(str(e))
    if ns.model != "default" and not os.path.exists(ns.model) and not is_hub_id(ns.model):
        parser.error(f"--model: no such model directory or file, and not a Hugging Face Hub id (owner/name): "
                     f"{ns.model!r}")
    return Cluster(num_prefill=ns.prefill, num_decode=ns.decode, model=ns.model,
                   transfer_backend=ns.transfer_backend, port=ns.port or None, host=ns.host, hosts=ns.hosts,
                   log_dir=ns.log_dir,
                   cpu_affinity=affinity, auto_placement=ns.cpu_affinity == "auto", core_loan=not ns.no_core_loan,
                   node_args=node_args, gpu_plan=gpu_plan,
                   prefill_args=prefill_args,
                   decode_args=decode_args, router_args=router_args, startup_timeout=ns.startup_timeout,
                   local_prefill_queue=ns.local_prefill_queue,
                   grace_period=ns.grace_period, cluster_secret_file=ns.cluster_secret_file,
                   restart=ns.max_restarts > 0, max_restarts=max(ns.max_restarts, 0),
                   restart_window=ns.restart_window)


def main(argv: list[str] | None = None) -> int:
    cluster = cluster_from_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()
    signals_seen = []

    def on_signal(signum, _frame) -> None:
        signals_seen.append(signum)
        if len(signals_seen) > 1:  # a second Ctrl-C: no more waiting
            cluster.grace_period = 0.0
        stop.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cluster.start()
        except ClusterError as e:
            print(f"pdserve cluster: {e}", file=sys.stderr)
            return 1
        url = cluster.url
        print(f"\nrouter: {url}   (logs: {cluster.log_dir})")
        for c in cluster.children:
            extra = f", bootstrap port {c.bootstrap_port}" if c.bootstrap_port else ""
            pin = f", cores {c.cores}" if c.cores else ""
            print(f"  {c.name:<10} {c.url}  pid {c.proc.pid}{extra}{pin}")
        print("\ntry:\n  curl -s " + url + "/v1/chat/completions -H 'content-type: application/json' \\\n"
              "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],"
              "\"max_tokens\":32,\"temperature\":0}'\n\nCtrl-C stops every process.", flush=True)
        while not stop.is_set():
            cluster.supervise()  # restarts and their back-off, one line per event
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)  # shutting down: no re-entry
        print("\nstopping the cluster ...", flush=True)
        cluster.stop()
        print("stopped", flush=True)
        for s, h in old.items():
            signal.signal(s, h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
