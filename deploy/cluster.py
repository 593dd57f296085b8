"""A whole PD cluster on this machine: N prefill nodes, M decode nodes and the router in front of them,
each a child process (deploy/nodes.py on deploy/process.py). `pdserve cluster` (deploy/cluster_cli.py)
is this class behind flags; the benches and the integration tests (tests/harness/nodes.py) start their
clusters with it too.

`start()` starts every node (`python -m prefill_node` / `python -m decode_node`, each with a free HTTP
port, every prefill node with its own free bootstrap port), waits until each answers `/health`, then
starts the router (`python -m router --pd-disaggregation ...`) and waits until `/readiness` says all its
workers are up. `stop()` stops the router first (no new traffic), then the nodes. Each child's stdout
and stderr go to `<log_dir>/<name>.log` (`prefill-0`, `decode-1`, `router`), which starts with its
command line; `<log_dir>/cluster.json` lists every child's command, ports, cores and pid. A child that
dies during start-up stops the launch with an error naming it and the tail of its log. `supervise()`
restarts a child that exits later (deploy/supervise.py).

Where the nodes run:

* cores: with `auto_placement` every node gets cores of its own and as many torch threads, so prefill
  and decode nodes do not fight over cores (deploy/placement.py), and decode node i borrows prefill
  node i's cores while that node has nothing to run (common/core_loan.py; `core_loan=False`: never).
  `cpu_affinity` instead pins every process of a role to the cores given. A pinned process's scheduler
  processes inherit the mask.
* GPUs: a `gpu_plan` (deploy/gpu_placement.py) adds each node's device flags.
* hosts: with `hosts` the router and every node run on a host of their own: a network namespace with
  its own address on a bridge (deploy/netns.py, needs root), as on separate machines; the namespaces
  go with the cluster.

Conditional disaggregation (`local_prefill_queue` N > 0): while a prefill node already has N of the
router's prefills in flight, the router sends the next request to a decode node alone, which prefills
it itself in chunks of `LOCAL_PREFILL_CHUNK` tokens, its running requests decoding a token inside each
chunk's forward (`--enable-mixed-chunk`); a second such request waits until the prefill node has 2N in
flight, and so on. On few cores the prefill node is the bottleneck while the decode node's steps are
bound by streaming the weights, so its spare batch slots are cheaper than a queue.

Everything listens on `host` and nowhere else: node HTTP, bootstrap servers, ZMQ control planes, the
router and its metrics server, and the transfer engines. That is why the default backend is nixl: it
can be confined to the host's interface, while mooncake listens on every interface (it warns at
start-up; deploy/README.md, "Security model"). Loopback is shared by every user of the machine, so each
start also gives the children a cluster secret (`$PDSERVE_CLUSTER_SECRET_FILE`): `cluster_secret_file`,
else that variable, else a fresh random one in `<log_dir>/cluster-secret` (mode 0600), which
authenticates the bootstrap and control-plane traffic between the nodes (`secret=False`: none, as in
the tests' clusters).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

from common import core_loan
from common.cluster_secret import ENV_VAR as SECRET_ENV
from common.role_rules import rules_for
from deploy.gpu_placement import GpuPlan
from deploy.nodes import RoleNode, RouterProcess, node_command, node_parser, router_command
from deploy.placement import Placement, plan
from deploy.process import ServerProcess, stop_all, wait_all
from deploy.procs import ClusterError, free_port, new_secret_file
from deploy.supervise import Supervisor

# the router's health checks unless its flags set them: a node that dies leaves the rotation within a
# few seconds and a restarted one is back a few seconds after its /health passes (sglang-router's
# defaults, a check a minute and three failures, would keep a dead node in for minutes)
HEALTH_DEFAULTS = (("--health-check-interval-secs", "2"), ("--health-failure-threshold", "2"),
                   ("--health-success-threshold", "2"))
# the chunk a decode node prefills a local request in: small enough that its running requests' next
# tokens never wait long behind it on a CPU core
LOCAL_PREFILL_CHUNK = 64
# prefills in flight on the prefill node before a decode node takes one itself (2N before a second, ...).
# A higher N gives a little more throughput with a fixed number of requests in flight, a lower one keeps
# more requests within latency SLOs under a Poisson stream (the one prefill core queues past the TTFT
# SLO at 4); 1 sends too much to the decode node. 3 read best on both (`pdserve bench placement` and
# `pdserve bench compare --cluster default` measure it).
DEFAULT_LOCAL_PREFILL_QUEUE = 3


def _has_flag(flags: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in flags)


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
    gpu_plan: GpuPlan | None = None  # device and GPUs per node (deploy/gpu_placement.py); None: nodes' own
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    router_health_defaults: bool = True  # add HEALTH_DEFAULTS the router flags do not set
    # conditional disaggregation: the router's --local-prefill-queue (0: off), and the decode nodes take
    # requests without a rendezvous, prefilled LOCAL_PREFILL_CHUNK tokens at a time, mixed with decode rows
    local_prefill_queue: int = 0
    # every node may switch its role (router/role_switch.py): each gets a bootstrap port, none a flag only
    # one role takes (the local-prefill ones, a core loan)
    switchable: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every child
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per role: {"prefill": {...}}
    startup_timeout: float = 600.0
    grace_period: float = 20.0
    quiet: bool = False
    secret: bool = True  # give the children a cluster secret (False: they inherit this environment's)
    # file with the secret every child gets; None: $PDSERVE_CLUSTER_SECRET_FILE, else a new one in log_dir
    cluster_secret_file: str | None = None
    # restarts of a child that exits after start-up (`supervise`); at most `max_restarts` per child
    # within `restart_window` seconds, after a back-off from `backoff_initial` doubling to `backoff_max`
    restart: bool = False
    max_restarts: int = 5
    restart_window: float = 600.0
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    children: list[ServerProcess] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._stopping = False
        self._supervisor_thread: threading.Thread | None = None
        self.net = None  # with `hosts`, a deploy.netns.Hosts: host 0 is the router, then the nodes
        self.placement = Placement()  # the automatic placement, once started with auto_placement
        self.supervisor = Supervisor(restart=self.restart, max_restarts=self.max_restarts,
                                     window=self.restart_window, backoff_initial=self.backoff_initial,
                                     backoff_max=self.backoff_max, respawn=self._respawn, say=self._say)

    # ------------------------------------------------------------------------------------ layout
    @property
    def prefills(self) -> list[RoleNode]:
        return [c for c in self.children if c.role == "prefill"]

    @property
    def decodes(self) -> list[RoleNode]:
        return [c for c in self.children if c.role == "decode"]

    @property
    def nodes(self) -> list[RoleNode]:
        return self.prefills + self.decodes

    @property
    def router(self) -> RouterProcess:
        for c in self.children:
            if c.role == "router":
                return c
        raise ClusterError("the cluster has no router (not started)")

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def events(self) -> list[tuple[float, str, str, str]]:
        """(wall time, child name, event, detail) of every exit, restart, recovery and give-up."""
        return self.supervisor.events

    def child(self, name: str) -> ServerProcess:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def servers(self) -> list[ServerProcess]:
        return list(self.children)

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    # ------------------------------------------------------------------------------------ commands
    def _node_flags(self, role: str, name: str | None) -> list[str]:
        """A node's flags after its address, port and backend: the local-prefill ones (before the
        given flags, so a given chunk size wins), the GPU plan's, then the given ones."""
        flags = []
        if role == "decode" and self.local_prefill_queue > 0:
            flags += ["--disaggregation-local-prefill", "--chunked-prefill-size", str(LOCAL_PREFILL_CHUNK)]
            if not _has_flag(self.node_args + self.decode_args, "--speculative-algorithm"):
                flags.append("--enable-mixed-chunk")  # (the two exclude each other)
        flags += self.gpu_plan.node_flags(name) if self.gpu_plan else []
        return flags + self.node_args + (self.prefill_args if role == "prefill" else self.decode_args)

    def _node_settings(self, role: str, bootstrap_port: int | None) -> dict:
        """A node's settings after its model, address and port."""
        settings = {"transfer_backend": self.transfer_backend}
        if role == "prefill" or bootstrap_port is not None:
            settings["disaggregation_bootstrap_port"] = bootstrap_port
        return settings

    def _node_cmd(self, role: str, port: int, bootstrap_port: int | None, host: str | None = None,
                  name: str | None = None) -> list[str]:
        """The command line of a node (without its core-loan flags)."""
        settings = {"model": self.model, "host": host or self.host, "port": port,
                    **self._node_settings(role, bootstrap_port)}
        return node_command(role, settings, self._node_flags(role, name))

    def _router_args(self) -> list[str]:
        args = []
        if self.local_prefill_queue > 0 and not _has_flag(self.router_args, "--local-prefill-queue"):
            args += ["--local-prefill-queue", str(self.local_prefill_queue)]
        if self.router_health_defaults:
            for flag, value in HEALTH_DEFAULTS:
                if not _has_flag(self.router_args, flag):
                    args += [flag, value]
        return args + self.router_args

    def _router_cmd(self, port: int, host: str | None = None) -> list[str]:
        return router_command(host or self.host, port, [(p.url, p.bootstrap_port) for p in self.prefills],
                              [d.url for d in self.decodes], self._router_args())

    def _no_core_loan(self) -> str | None:
        """Why the decode nodes cannot borrow their prefill node's cores (None: they can)."""
        if not self.core_loan:
            return "turned off"
        parser = node_parser()
        for role, flags in (("prefill", self.node_args + self.prefill_args),
                            ("decode", self.node_args + self.decode_args)):
            ns, _ = parser.parse_known_args(flags)
            if ns.core_loan_file or ns.core_loan_cores:
                return f"the {role} flags set the core loan themselves"
            why = rules_for(role).core_loan_unsupported(ns)
            if why:
                return f"the {role} nodes' flags: {why}"
        return None

    def _loan_args(self, name: str) -> list[str]:
        """The core-loan flags of node `name`: the lender and its borrower share a file in the log
        directory, which this creates for the lender (prefill nodes come first)."""
        loans = self.placement.loans
        lender = loans.get(name, name if name in loans.values() else None)
        if lender is None:
            return []
        path = os.path.join(self.log_dir, f"core-loan-{lender}")
        if name == lender:
            core_loan.open_loan_file(path).close()  # mode 0600; the lender writes BUSY when it starts
            return ["--core-loan-file", path]
        cores = ",".join(map(str, self.placement.cores[lender]))
        return ["--core-loan-file", path, "--core-loan-cores", cores]

    # ------------------------------------------------------------------------------------ children
    def _env(self, role: str, name: str) -> dict[str, str]:
        return {**({SECRET_ENV: self.cluster_secret_file} if self.secret else {}), **self.env,
                **(self.placement.node_env(name) if role != "router" else {}), **self.role_env.get(role, {})}

    def _node(self, role: str, name: str, host: str, netns: str | None) -> RoleNode:
        cores = self.placement.cores[name] if self.auto_placement else self.cpu_affinity.get(role)
        # no port given: the node picks its own, and new ones after a port race
        settings = self._node_settings(role, free_port(self.host) if role == "prefill" or self.switchable
                                       else None)
        return RoleNode(role, self.model, name=name, host=host, netns=netns, cores=cores,
                        log_path=os.path.join(self.log_dir, f"{name}.log"), env=self._env(role, name),
                        startup_timeout=self.startup_timeout, echo_command=True, log_level=None,
                        flags=self._node_flags(role, name) + self._loan_args(name), **settings)

    def _spawn(self, c: ServerProcess) -> None:
        # the supervisor thread lives as long as the children it restarts: they may die with it
        c.spawn(die_with_parent=True if threading.current_thread() is self._supervisor_thread else None)
        self.supervisor.started(c)

    def _respawn(self, c: ServerProcess) -> None:
        self._spawn(c)
        self.write_manifest()

    def _port_race_restart(self, c: ServerProcess) -> None:
        self.supervisor.started(c)
        self._say(f"  {c.name}: a port was taken while it started; retrying on port {c.port}")
        self.write_manifest()

    def _wait(self, servers: list[ServerProcess], deadline: float) -> None:
        wait_all(servers, deadline, on_ready=lambda s: self._say(f"  {s.name} ready at {s.url}"),
                 on_restart=self._port_race_restart)

    # ------------------------------------------------------------------------------------ start / stop
    def start(self) -> Cluster:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ClusterError("a PD cluster needs at least one prefill and one decode node")
        if self.log_dir is None:
            self.log_dir = os.path.join(os.getcwd(), "logs", time.strftime("cluster-%Y%m%d-%H%M%S"))
        os.makedirs(self.log_dir, exist_ok=True)
        if self.secret:
            self.cluster_secret_file = self.cluster_secret_file or os.environ.get(SECRET_ENV) or \
                new_secret_file(os.path.join(self.log_dir, "cluster-secret"))
        self.children = []
        places = self._places()
        self._choose_placement()
        for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for i in range(n):
                self.children.append(self._node(role, f"{role}-{i}", *places[len(self.children) + 1]))
        self._say(f"starting {self.num_prefill} prefill + {self.num_decode} decode nodes "
                  f"({self.transfer_backend} backend, model {self.model}); logs in {self.log_dir}")
        deadline = time.time() + self.startup_timeout
        try:
            for c in self.children:
                self._spawn(c)
            self.write_manifest()
            self._wait(list(self.children), deadline)
            router = RouterProcess(self.prefills, self.decodes, *self._router_args(), port=self.port,
                                   host=places[0][0], netns=places[0][1],
                                   cores=self.cpu_affinity.get("router"),
                                   log_path=os.path.join(self.log_dir, "router.log"),
                                   env=self._env("router", "router"), startup_timeout=self.startup_timeout,
                                   echo_command=True)
            self.children.append(router)
            self._spawn(router)
            self._wait([router], deadline)
        except BaseException:
            self.stop()
            raise
        self.write_manifest()
        return self

    def _choose_placement(self) -> None:
        """Choose the automatic placement, and say what was chosen."""
        if self.auto_placement:
            why_not = self._no_core_loan()
            cores = sorted(self.cores or os.sched_getaffinity(0))
            self.placement = plan(self.num_prefill, self.num_decode, cores, loans=why_not is None)
            self._say(self.placement.describe() + (f" (no core loan: {why_not})" if why_not else ""))
        if self.gpu_plan and self.gpu_plan.describe():
            self._say(self.gpu_plan.describe())
        if self.local_prefill_queue > 0:
            q = self.local_prefill_queue
            self._say(f"conditional disaggregation: a decode node prefills a request itself while its "
                      f"prefill node has {q}+ prefills in flight ({2 * q}+ for a second), in chunks of "
                      f"{LOCAL_PREFILL_CHUNK} tokens its running requests decode in "
                      "(--local-prefill-queue 0: off)")

    def _places(self) -> list[tuple[str, str | None]]:
        """(address, network namespace) of the router, then of each node: all on `host`, or with `hosts`
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
            json.dump({"router": routers[0].url if routers else None,
                       "transfer_backend": self.transfer_backend, "model": self.model,
                       "children": [c.describe() for c in self.children]}, f, indent=2)

    def stop(self) -> None:
        """Router first (no new traffic), then every node; no restart from here on."""
        self._stopping = True
        if self._supervisor_thread is not None:
            self._supervisor_thread.join(timeout=30)
        stop_all([c for c in self.children if c.role == "router"], self.grace_period, self._say)
        stop_all(self.nodes, self.grace_period, self._say)
        if self.net is not None:
            self.net.close()
            self.net = None

    def kill(self, name: str) -> None:
        """SIGKILL a child and its whole process group (a crash, for failure tests); not restarted."""
        c = self.child(name)
        c.kill()
        self.supervisor.killed(c)

    # ------------------------------------------------------------------------------------ supervision
    def supervise(self, now: float | None = None) -> None:
        """One pass of restarts (deploy/supervise.py); one line per event, unless `quiet`."""
        if not self._stopping:
            self.supervisor.check(list(self.children), now)

    def start_supervisor(self, interval: float = 0.5) -> None:
        """`supervise()` every `interval` seconds on a daemon thread until `stop()`."""
        def loop() -> None:
            while not self._stopping:
                try:
                    self.supervise()
                except Exception as e:  # keep supervising whatever one pass raised
                    self._say(f"supervisor pass failed: {type(e).__name__}: {e}")
                time.sleep(interval)

        self._supervisor_thread = threading.Thread(target=loop, name="cluster-supervisor", daemon=True)
        self._supervisor_thread.start()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
