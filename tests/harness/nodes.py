"""What the tests start, and the `Launcher` behind their fixtures. Spawning, waiting and stopping are
deploy's (deploy/process.py, deploy/nodes.py, deploy/cluster.py): the suite starts its servers the way
`pdserve cluster` does. This module adds what only the tests need.

    ServerProcess, NodeProcess, RoleNode,    deploy's servers (re-exported): one child process each, in a
    NodeGroup, start_together, stop_all      session of its own with its log file, started side by side
                                             and stopped together
    RouterProcess(prefills, decodes, *args)  deploy's router, with `post(path, body)` for the tests
    PDPair(prefill, decode)                  a prefill and a decode node, and the dual dispatch a PD
                                             router does, sent by the test itself
    RouterCluster(model, log_dir, ...)       deploy's `Cluster` described the tests' way: node settings as
                                             ServerArgs fields, no cluster secret, no CPU placement, the
                                             router's flags as given
    Launcher(log_dir)                        starts any of these and stops them all on close(); the
                                             `launcher` / `module_launcher` / `session_launcher` fixtures
                                             of tests/conftest.py are Launchers, and a failed test's report
                                             shows the tail of their servers' logs
    thread_names(pid)                        a process's thread names, from /proc
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import random
from pathlib import Path

from deploy import nodes
from deploy.cluster import Cluster
from deploy.nodes import NodeGroup, NodeProcess, RoleNode, settings_flags
from deploy.process import ROOT, ServerProcess, start_together, stop_all
from tests.harness.client import free_port, http, http_post

__all__ = ["ROOT", "Launcher", "NodeGroup", "NodeProcess", "PDPair", "RoleNode", "RouterCluster",
           "RouterProcess", "ServerProcess", "free_port", "start_together", "stop_all", "thread_names"]


class RouterProcess(nodes.RouterProcess):
    """deploy's router process, with a POST helper."""

    def post(self, path: str, body, headers=None):
        """(status, headers, body) of a POST to the router."""
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

        return (wait_restored(self.prefill, free_counts(self.prefill)),
                wait_restored(self.decode, free_counts(self.decode)))

    def servers(self) -> list[ServerProcess]:
        return [self.prefill, self.decode]

    def start(self) -> PDPair:
        start_together([self.prefill, self.decode])
        return self

    def stop(self) -> None:
        stop_all([self.prefill, self.decode])


# ---------------------------------------------------------------------------------------------- cluster
class RouterCluster(Cluster):
    """N prefill + M decode nodes (`prefill-0`, `decode-1`, ...) and the router in front of them, each
    child's log in `log_dir/<name>.log`: deploy's `Cluster` with `node_settings` (every node) and
    `role_settings` ({"decode": {...}}) as ServerArgs fields, logging at info unless they say otherwise.
    Its children inherit the test's environment (no cluster secret of their own), run on any core, and
    the router gets exactly `router_args`."""

    def __init__(self, model: str, log_dir: str | Path, *, backend: str = "fake", prefill: int = 1,
                 decode: int = 1, node_settings: dict | None = None, router_args: list[str] | None = None,
                 env: dict | None = None, role_env: dict | None = None, role_settings: dict | None = None,
                 startup_timeout: float = 300.0, grace_period: float = 15.0, switchable: bool = False):
        common = {"log_level": "info", **(node_settings or {})}
        per_role = role_settings or {}
        super().__init__(num_prefill=prefill, num_decode=decode, model=model, transfer_backend=backend,
                         log_dir=str(log_dir),
                         prefill_args=settings_flags({**common, **per_role.get("prefill", {})}),
                         decode_args=settings_flags({**common, **per_role.get("decode", {})}),
                         router_args=list(router_args or []), router_health_defaults=False,
                         env=dict(env or {}), role_env=dict(role_env or {}), startup_timeout=startup_timeout,
                         grace_period=grace_period, quiet=True, secret=False, switchable=switchable)
        self.baseline: dict = {}  # pool figures a fixture takes once the cluster is up


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

    def pair(self, model: str, backend: str, *, prefill_tp: int = 1, decode_tp: int = 1,
             env: dict | None = None, settings: dict | None = None, prefill_settings: dict | None = None,
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
                node_settings: dict | None = None, role_settings: dict | None = None,
                switchable: bool = False) -> RouterCluster:
        """Router + `prefill` + `decode` nodes with the integration suite's settings
        (tests.harness.cluster: NODE_SETTINGS, ROUTER_ARGS, ENV); `router_args` and `env` add to them,
        `role_settings` ({"decode": {...}}) to one role's nodes."""
        from tests.harness.cluster import ENV, NODE_SETTINGS, ROUTER_ARGS

        log_dir = self.log_dir / f"{next(self._names):02d}-cluster-{backend}"
        return self.start(RouterCluster(model, log_dir, backend=backend, prefill=prefill, decode=decode,
                                        node_settings={**NODE_SETTINGS, **(node_settings or {})},
                                        router_args=ROUTER_ARGS + list(router_args or []),
                                        env={**ENV, **(env or {})}, role_env=role_env,
                                        role_settings=role_settings, switchable=switchable))

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
        return "\n".join(f"--- {s.name} ({s.log_path}, "
                         f"{'running' if s.alive() else 'exited'}):\n{s.log_tail(n)}"
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
        stop_all([s for s in servers if isinstance(s, nodes.RouterProcess)])
        stop_all([s for s in servers if not isinstance(s, nodes.RouterProcess)])
        for thing in things:  # a cluster's supervisor and network namespaces
            if isinstance(thing, Cluster):
                thing.stop()


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
