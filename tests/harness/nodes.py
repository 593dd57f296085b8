"""The one way the tests start a server process, and what they build from it.

`ServerProcess` spawns one server on 127.0.0.1 in its own session (process group), with stdout+stderr
in a log file, waits until its readiness URL answers 200 (a server that exits first fails with the tail
of its log; one that lost a race for its port is started again on new ports, at most 3 times), and on
`stop()` sends SIGTERM, waits, then SIGKILLs the whole group so no scheduler process is left behind.
A child spawned from the main thread also gets SIGTERM if the test process dies (PR_SET_PDEATHSIG).

    NodeProcess(model, **settings)          a colocated node (`launch_server`, what `pdserve serve` runs)
    RoleNode("prefill"|"decode", model, ...) `python -m prefill_node` / `python -m decode_node`
    RouterProcess(prefills, decodes, *args)  `python -m router --pd-disaggregation ...`
    PDPair(prefill, decode)                  a prefill and a decode node, and a router's dual dispatch
    RouterCluster(...)                       N prefill + M decode nodes and a router in front of them
    Launcher(log_dir)                        starts any of these and stops them all on close();
                                             the `launcher` / `module_launcher` / `session_launcher`
                                             fixtures of tests/conftest.py are Launchers, and a failed
                                             test's report shows the tail of their servers' logs
    thread_names(pid)                        a process's thread names, from /proc
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.harness.client import free_port, http_get, http_post

ROOT = Path(__file__).resolve().parents[2]

_SERVE_SCRIPT = (
    "import json, sys\n"
    "from common.config import ServerArgs\n"
    "from common.log import exit_now\n"
    "from common.server.launch import launch_server\n"
    "args = ServerArgs(**json.loads(sys.argv[1]))\n"
    "args.validate()\n"
    "launch_server(args)\n"
    "exit_now(0)\n"
)


def _prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_parent() -> None:  # between fork and exec
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def settings_flags(settings: dict) -> list[str]:
    """{"page_size": 4, "disable_radix_cache": True} -> ["--page-size", "4", "--disable-radix-cache"]"""
    out = []
    for k, v in settings.items():
        if v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                out.append(flag)
        else:
            out += [flag, str(v)]
    return out


class ServerProcess:
    """One server process; subclasses say how to start it (`command`) and when it is ready."""

    ready_path = "/health"

    def __init__(self, name: str, *, port: int | None = None, env: dict | None = None,
                 log_path: str | Path | None = None, startup_timeout: float = 300.0,
                 netns: str | None = None, host: str = "127.0.0.1"):
        self.name = name
        # a server on a host of its own: run inside network namespace `netns`, listening on `host`
        # (deploy/netns.py makes them)
        self.netns = netns
        self.host = host
        self.role = name
        self.port = port or free_port()
        self._own_port = port is None  # only a port we picked may be replaced after a port race
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), self.env.get("PYTHONPATH")) if p)
        if log_path is None:
            log_path = tempfile.mkstemp(prefix=f"pdserve-{name}-", suffix=".log")[1]
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port_retries = 0

    # ------------------------------------------------------------------ what subclasses define
    def command(self) -> list[str]:
        raise NotImplementedError

    def new_ports(self) -> None:
        """Pick new ports after losing a race for one."""
        self.port = free_port()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def spawn(self) -> ServerProcess:
        """Start the process and return at once (`wait_ready` waits for it)."""
        pdeathsig = _PRCTL is not None and threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log:
            prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
            self.proc = subprocess.Popen(prefix + self.command(), cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent if pdeathsig else None)
        return self

    def is_ready(self) -> bool:
        try:
            return http_get(self.url + self.ready_path, timeout=2)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float | None = None) -> ServerProcess:
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                if self._lost_port_race():
                    self.port_retries += 1
                    self.new_ports()
                    self.spawn()
                    continue
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} during start-up "
                                   f"(log {self.log_path}):\n{self.log_tail()}")
            if self.is_ready():
                return self
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s (log {self.log_path}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def _lost_port_race(self) -> bool:
        return self._own_port and self.port_retries < 3 and "address already in use" in self.log_tail(60).lower()

    def start(self) -> ServerProcess:
        self.spawn()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:]) or "(empty log)"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait for a clean exit (returns the exit code); SIGKILL the group if it hangs."""
        stop_all([self], timeout)
        return None if self.proc is None else self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group (front end and schedulers): a crash."""
        if self.proc is None:
            return
        _killpg(self.proc)
        self.proc.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def thread_names(pid: int) -> list[str]:
    """The names (`comm`) of a running process's threads, from /proc."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(servers: list[ServerProcess], timeout: float = 30.0) -> None:
    """SIGTERM every one, give them `timeout` seconds together, then SIGKILL each process group
    (what a crashed front end left behind, too)."""
    running = [s for s in servers if s.proc is not None]
    for s in running:
        if s.proc.poll() is None:
            try:
                s.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + timeout
    for s in running:
        try:
            s.proc.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
        _killpg(s.proc)
        try:
            s.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------------------------------------- nodes
class NodeProcess(ServerProcess):
    """A colocated node: `launch_server(ServerArgs(**settings))`, what `pdserve serve` runs.

        with NodeProcess(model_dir, max_total_tokens=2048) as node:
            requests go to node.url
    """

    def __init__(self, model: str, *, startup_timeout: float = 300.0, env: dict | None = None,
                 log_path: str | Path | None = None, name: str = "node", **settings):
        netns = settings.pop("netns", None)
        super().__init__(name, port=settings.pop("port", None), env=env, log_path=log_path,
                         startup_timeout=startup_timeout, netns=netns, host=settings.get("host", "127.0.0.1"))
        self.settings = {"model": model, "host": self.host, "port": self.port, "log_level": "info", **settings}

    def new_ports(self) -> None:
        super().new_ports()
        self.settings["port"] = self.port

    def command(self) -> list[str]:
        return [sys.executable, "-c", _SERVE_SCRIPT, json.dumps(self.settings)]

    def stats(self) -> dict:
        status, body = http_get(self.url + "/server_info", timeout=30)
        assert status == 200, body
        return json.loads(body)["stats"]


class RoleNode(NodeProcess):
    """A prefill or decode node started with `python -m prefill_node` / `python -m decode_node`."""

    def __init__(self, role: str, model: str, *, name: str | None = None, **settings):
        super().__init__(model, name=name or role, **settings)
        self.role = role

    @property
    def bootstrap_port(self) -> int | None:
        return self.settings.get("disaggregation_bootstrap_port")

    def new_ports(self) -> None:
        super().new_ports()
        if self.bootstrap_port is not None:
            self.settings["disaggregation_bootstrap_port"] = free_port()

    def command(self) -> list[str]:
        return [sys.executable, "-m", f"{self.role}_node", *settings_flags(self.settings)]


class RouterProcess(ServerProcess):
    """`python -m router --pd-disaggregation`: each prefill worker with its `bootstrap_port` (`ports`
    overrides it: a number, "none", or None for no port on the command line), ready at /readiness."""

    ready_path = "/readiness"

    def __init__(self, prefill: list, decode: list, *args: str, ports: dict | None = None, name: str = "router",
                 **kw):
        super().__init__(name, **kw)
        self.prefill, self.decode, self.args, self.ports = list(prefill), list(decode), list(args), ports or {}

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "router", "--pd-disaggregation", "--host", self.host, "--port", str(self.port)]
        for w in self.prefill:
            port = self.ports.get(w, w.bootstrap_port)
            cmd += ["--prefill", w.url] + ([] if port is None else [str(port)])
        for w in self.decode:
            cmd += ["--decode", w.url]
        if not any(a.startswith("--prometheus-port") for a in self.args):
            cmd += ["--prometheus-port", "0"]  # /metrics on the router's own port
        return cmd + self.args

    def post(self, path: str, body, headers=None):
        from tests.harness.client import http

        return http("POST", self.url + path, body, headers)


# ---------------------------------------------------------------------------------------------- PD pair
_rooms = itertools.count(random.Random().randrange(1 << 40))


class PDPair:
    """A prefill and a decode node, and the dual dispatch a PD router does: the same body with
    bootstrap_host/port/room to both nodes at once, the decode answer back."""

    def __init__(self, prefill: RoleNode, decode: RoleNode):
        self.prefill = prefill
        self.decode = decode

    @property
    def bootstrap_port(self) -> int:
        return self.prefill.bootstrap_port

    def body(self, body: dict, room: int | None = None) -> dict:
        return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": next(_rooms) if room is None else room}

    def generate(self, body: dict, timeout: float = 120.0,
                 room: int | None = None) -> tuple[tuple[int, dict], tuple[int, dict]]:
        """(prefill status, json), (decode status, json) of one request sent to both at once (with
        `room`, else a fresh one)."""
        full = self.body(body, room)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(http_post, self.prefill.url + "/generate", full, None, timeout)
            fd = ex.submit(http_post, self.decode.url + "/generate", full, None, timeout)
            (ps, pb), (ds, db) = fp.result(), fd.result()
        return (ps, json.loads(pb)), (ds, json.loads(db))

    def start_counts(self) -> tuple[dict, dict]:
        """Both nodes' free pages, slots and queues once they are idle (see tests.harness.pd)."""
        from tests.harness.pd import free_counts, wait_restored

        return wait_restored(self.prefill, free_counts(self.prefill)), wait_restored(self.decode, free_counts(self.decode))

    def servers(self) -> list[ServerProcess]:
        return [self.prefill, self.decode]

    def start(self) -> PDPair:
        start_together([self.prefill, self.decode])
        return self

    def stop(self) -> None:
        stop_all([self.prefill, self.decode])


def start_together(servers: list[ServerProcess]) -> None:
    """Spawn every one, then wait for each: they start up side by side. On a failure all are stopped."""
    try:
        for s in servers:
            s.spawn()
        for s in servers:
            s.wait_ready()
    except BaseException:
        stop_all(servers)
        raise


class NodeGroup:
    """Servers a Launcher starts together and stops with the rest (`launcher.start(NodeGroup([...]))`)."""

    def __init__(self, nodes: list[ServerProcess]) -> None:
        self.nodes = nodes

    def start(self):
        start_together(self.nodes)
        return self

    def stop(self) -> None:
        stop_all(self.nodes)

    def servers(self) -> list[ServerProcess]:
        return list(self.nodes)


# ---------------------------------------------------------------------------------------------- cluster
class RouterCluster:
    """N prefill + M decode nodes (`prefill-0`, `decode-1`, ...) and the router in front of them, each
    node's log in `log_dir/<name>.log`. The router starts once every node answers /health."""

    def __init__(self, model: str, log_dir: str | Path, *, backend: str = "fake", prefill: int = 1, decode: int = 1,
                 node_settings: dict | None = None, router_args: list[str] | None = None, env: dict | None = None,
                 role_env: dict | None = None, role_settings: dict | None = None, startup_timeout: float = 300.0,
                 grace_period: float = 15.0):
        self.log_dir = str(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self.grace_period = grace_period
        self.baseline: dict = {}
        self.children: list[ServerProcess] = []
        for role, n in (("prefill", prefill), ("decode", decode)):
            for i in range(n):
                extra = {"disaggregation_bootstrap_port": free_port()} if role == "prefill" else {}
                self.children.append(RoleNode(
                    role, model, name=f"{role}-{i}", log_path=Path(self.log_dir, f"{role}-{i}.log"),
                    env={**(env or {}), **(role_env or {}).get(role, {})}, startup_timeout=startup_timeout,
                    transfer_backend=backend, **extra, **{**(node_settings or {}), **(role_settings or {}).get(role, {})}))
        self.children.append(RouterProcess(self.prefills, self.decodes, *(router_args or []),
                                           env={**(env or {}), **(role_env or {}).get("router", {})},
                                           log_path=Path(self.log_dir, "router.log"), startup_timeout=startup_timeout))

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
        return self.children[-1]

    @property
    def url(self) -> str:
        return self.router.url

    def child(self, name: str) -> ServerProcess:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def kill(self, name: str) -> None:
        """SIGKILL a child and its whole process group (a crash, for failure tests)."""
        self.child(name).kill()

    def servers(self) -> list[ServerProcess]:
        return list(self.children)

    def start(self) -> RouterCluster:
        try:
            start_together(self.nodes)
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router first (no new traffic), then every node."""
        stop_all([self.router], self.grace_period)
        stop_all(self.nodes, self.grace_period)


# ---------------------------------------------------------------------------------------------- launcher
class Launcher:
    """Starts servers, pairs and clusters with their logs under `log_dir`, and stops every one it
    started on `close()` (last started first)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._started: list = []
        self._names = itertools.count()

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{next(self._names):02d}-{name}.log"

    def start(self, thing):
        """Start a ServerProcess, PDPair or RouterCluster and stop it on close()."""
        self._started.append(thing)
        return thing.start()

    def colocated(self, model: str, **settings) -> NodeProcess:
        """A colocated node (NodeProcess settings: ServerArgs fields, `env`, `startup_timeout`)."""
        return self.start(NodeProcess(model, log_path=self.log_path("node"), **settings))

    def pair(self, model: str, backend: str, *, prefill_tp: int = 1, decode_tp: int = 1, env: dict | None = None,
             settings: dict | None = None, prefill_settings: dict | None = None,
             decode_settings: dict | None = None) -> PDPair:
        """A prefill node (tp `prefill_tp`, its own bootstrap port) and a decode node (tp `decode_tp`)
        over `backend`; `settings` go to both (default: tests.harness.pd.BASE), the role ones on top,
        `env` on top of tests.harness.pd.FAST_ENV."""
        from tests.harness.pd import BASE, FAST_ENV

        env = {**FAST_ENV, **(env or {})}
        common = {**(BASE if settings is None else settings), "transfer_backend": backend}
        prefill = RoleNode("prefill", model, env=env, log_path=self.log_path("prefill"), tp=prefill_tp,
                           disaggregation_bootstrap_port=free_port(), disaggregation_decode_tp=decode_tp,
                           **{**common, **(prefill_settings or {})})
        decode = RoleNode("decode", model, env=env, log_path=self.log_path("decode"), tp=decode_tp,
                          **{**common, **(decode_settings or {})})
        return self.start(PDPair(prefill, decode))

    def cluster(self, model: str, *, backend: str = "fake", prefill: int = 2, decode: int = 2,
                router_args: list[str] | None = None, env: dict | None = None, role_env: dict | None = None,
                node_settings: dict | None = None, role_settings: dict | None = None) -> RouterCluster:
        """Router + `prefill` + `decode` nodes with the integration suite's settings
        (tests.harness.cluster: NODE_SETTINGS, ROUTER_ARGS, ENV); `router_args` and `env` add to them,
        `role_settings` ({"decode": {...}}) to one role's nodes."""
        from tests.harness.cluster import ENV, NODE_SETTINGS, ROUTER_ARGS

        log_dir = self.log_dir / f"{next(self._names):02d}-cluster-{backend}"
        return self.start(RouterCluster(model, log_dir, backend=backend, prefill=prefill, decode=decode,
                                        node_settings={**NODE_SETTINGS, **(node_settings or {})},
                                        router_args=ROUTER_ARGS + list(router_args or []),
                                        env={**ENV, **(env or {})}, role_env=role_env,
                                        role_settings=role_settings))

    def router(self, prefill: list, decode: list, *args: str, ports: dict | None = None,
               wait: bool = True) -> RouterProcess:
        """A router in front of `prefill` / `decode` workers (anything with `url`, and `bootstrap_port`
        for prefill); with wait=False it is only spawned (`wait_ready()` later)."""
        r = RouterProcess(prefill, decode, *args, ports=ports, log_path=self.log_path("router"))
        self._started.append(r)
        return r.start() if wait else r.spawn()

    def servers(self) -> list[ServerProcess]:
        """Every server process started so far (those of pairs and clusters too)."""
        out = []
        for thing in self._started:
            out += thing.servers() if hasattr(thing, "servers") else [thing]
        return out

    def log_tails(self, n: int = 25) -> str:
        """The last `n` lines of every server's log, for a failed test's report."""
        return "\n".join(f"--- {s.name} ({s.log_path}, {'running' if s.alive() else 'exited'}):\n{s.log_tail(n)}"
                         for s in self.servers())

    def close(self) -> None:
        """Stop everything at once (routers first): a clean exit takes each server a second or two, and
        one after another those seconds add up over a suite."""
        things, self._started = self._started[::-1], []
        servers = []
        for thing in things:
            if hasattr(thing, "servers"):
                servers += thing.servers()
            elif isinstance(thing, ServerProcess):
                servers.append(thing)
            else:
                thing.stop()
        stop_all([s for s in servers if isinstance(s, RouterProcess)])
        stop_all([s for s in servers if not isinstance(s, RouterProcess)])
