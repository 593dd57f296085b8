"""One server as a child process: start it, wait until it is ready, stop it.

Every process the launcher starts -- a node, a router, a test's stand-in worker -- is a
`ServerProcess`; subclasses say how to start it (`command()`) and where it answers when ready
(`ready_path`). The `Cluster` of deploy/cluster.py (`pdserve cluster` and the benches' clusters), the
tests (tests/harness/nodes.py) and the benches' own nodes, routers and stand-ins start through it.

* Start: the child runs in a session (process group) of its own, with stdout and stderr in its log
  file, optionally pinned to cores and inside a network namespace (`ip netns exec`). A child started
  from the main thread, or from a thread that lives as long as it (the cluster's supervisor), gets
  SIGTERM when its parent dies (PR_SET_PDEATHSIG), so a launcher killed hard leaves no orphans. That
  signal follows the thread, not the process, which is why a child started from a short-lived thread
  does not get it.
* Ready: `wait_all` polls each server's readiness URL until it answers 200. A server that exits first
  fails the start with the tail of its log, unless it lost a race for a port it was given by
  `free_port` (another process bound it first): then it gets new ports and starts again, at most 3
  times.
* Stop: `stop_all` sends SIGTERM to every server, gives them a grace period together, then SIGKILLs
  each whole process group, so no scheduler process of a crashed front end is left behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from deploy.procs import ClusterError, free_port, http_status

ROOT = str(Path(__file__).resolve().parents[1])
PORT_RETRIES = 3  # starts on new ports after losing a port race
POLL_INTERVAL = 0.2  # seconds between readiness checks


def _resolve_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None


_PRCTL = _resolve_prctl()


def die_with_parent() -> None:
    """Linux: SIGTERM this process when the thread that started it ends (PR_SET_PDEATHSIG); for a
    `preexec_fn`, between fork and exec."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class ServerProcess:
    """One server process; subclasses define `command()` and, if they are ready elsewhere, `ready_path`."""

    ready_path = "/health"
    bootstrap_port: int | None = None  # a prefill node's (deploy/nodes.py RoleNode)

    def __init__(self, name: str, *, port: int | None = None, host: str = "127.0.0.1",
                 env: dict | None = None, log_path: str | Path | None = None, startup_timeout: float = 300.0,
                 netns: str | None = None, cores: list[int] | None = None, echo_command: bool = False):
        self.name = name
        self.role = name
        self.host = host  # the address it listens on
        self.netns = netns  # its network namespace (deploy/netns.py), None: this one
        self.cores = cores  # the cores it may run on, None: any
        self.port = port or self.pick_port()
        self.own_port = port is None  # only a port we picked may be replaced after a port race
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, self.env.get("PYTHONPATH")) if p)
        if log_path is None:
            log_path = tempfile.mkstemp(prefix=f"pdserve-{name}-", suffix=".log")[1]
        self.log_path = Path(log_path)
        self.echo_command = echo_command  # write "$ command" into the log at every start
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.cmd: list[str] = []  # the command of the last start
        self.port_retries = 0

    # ------------------------------------------------------------------ what subclasses define
    def command(self) -> list[str]:
        raise NotImplementedError

    def pick_port(self) -> int:
        # inside a namespace of its own every port is free; its address is not one of this namespace
        return free_port("127.0.0.1" if self.netns else self.host)

    def new_ports(self) -> None:
        """Pick new ports after losing a race for one."""
        self.port = self.pick_port()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def spawn(self, die_with_parent: bool | None = None) -> ServerProcess:
        """Start the process and return at once (`wait_ready` waits for it). `die_with_parent`: give
        it PR_SET_PDEATHSIG (None: when called from the main thread)."""
        if die_with_parent is None:
            die_with_parent = threading.current_thread() is threading.main_thread()
        pdeathsig = die_with_parent and _PRCTL is not None
        cores = self.cores

        def in_child() -> None:  # between fork and exec
            if pdeathsig:
                _PRCTL(1, signal.SIGTERM)
            if cores:
                os.sched_setaffinity(0, cores)

        self.cmd = self.command()
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        with open(self.log_path, "ab") as log:
            if self.echo_command:
                log.write(f"$ {shlex.join(prefix + self.cmd)}\n".encode())
                log.flush()
            self.proc = subprocess.Popen(prefix + self.cmd, cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=in_child if pdeathsig or cores else None)
        return self

    def is_ready(self, timeout: float = 2.0) -> bool:
        return http_status(self.url + self.ready_path, timeout=timeout) == 200

    def lost_port_race(self) -> bool:
        return self.own_port and self.port_retries < PORT_RETRIES and \
            "address already in use" in self.log_tail(60).lower()

    def wait_ready(self, timeout: float | None = None) -> ServerProcess:
        wait_all([self], time.time() + (self.startup_timeout if timeout is None else timeout))
        return self

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

    def describe(self) -> dict:
        """What cluster.json says about it."""
        return {"name": self.name, "role": self.role, "url": self.url, "port": self.port,
                "bootstrap_port": self.bootstrap_port, "cores": self.cores,
                "log": str(self.log_path), "netns": self.netns, "pid": self.proc.pid if self.proc else None,
                "cmd": self.cmd}

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

    def group_gone(self, timeout: float = 10.0) -> None:
        """SIGKILL what is left of the process group (a dead front end's scheduler ranks hold its
        ports) and wait until the group is empty."""
        if self.proc is None:
            return
        _killpg(self.proc)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_all(servers: list[ServerProcess], deadline: float,
             on_ready: Callable[[ServerProcess], None] | None = None,
             on_restart: Callable[[ServerProcess], None] | None = None) -> None:
    """Wait until every one of `servers` (spawned) is ready, calling `on_ready` for each as it is;
    one that lost a port race starts again on new ports (`on_restart` after), one that exited or is
    not ready by `deadline` (time.time()) raises ClusterError with its log's tail."""
    started = time.time()
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                if s.lost_port_race():
                    s.port_retries += 1
                    s.new_ports()
                    s.spawn()
                    if on_restart is not None:
                        on_restart(s)
                    continue
                raise ClusterError(f"{s.name} exited with code {s.proc.returncode} during start-up "
                                   f"(log {s.log_path}):\n{s.log_tail(40)}")
            if s.is_ready():
                pending.remove(s)
                if on_ready is not None:
                    on_ready(s)
        if not pending:
            return
        if time.time() > deadline:
            names = ", ".join(s.name for s in pending)
            tails = "\n".join(f"--- {s.name} ({s.log_path}):\n{s.log_tail(15)}" for s in pending)
            raise ClusterError(f"not ready after {time.time() - started:.0f}s: {names}\n{tails}")
        time.sleep(POLL_INTERVAL)


def start_together(servers: list[ServerProcess]) -> None:
    """Spawn every one, then wait for all: they start up side by side. On a failure all are stopped."""
    try:
        for s in servers:
            s.spawn()
        wait_all(servers, time.time() + max((s.startup_timeout for s in servers), default=0.0))
    except BaseException:
        stop_all(servers)
        raise


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(servers: list[ServerProcess], timeout: float = 30.0,
             say: Callable[[str], None] | None = None) -> None:
    """SIGTERM every one, give them `timeout` seconds together, then SIGKILL each process group
    (what a crashed front end left behind, too). `say` is told of each that had to be killed."""
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
            if say is not None:
                say(f"  {s.name} did not stop within {timeout:.0f}s: killing it")
        _killpg(s.proc)
        try:
            s.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
