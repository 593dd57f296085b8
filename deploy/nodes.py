"""The servers of a PD deployment as child processes, each a `ServerProcess` (deploy/process.py):

    NodeProcess(model, **settings)             a colocated node: `launch_server(ServerArgs(**settings))`,
                                               what `pdserve serve` runs
    RoleNode("prefill"|"decode", model, ...)   `python -m prefill_node` / `python -m decode_node`
    RouterProcess(prefills, decodes, *args)    `python -m router --pd-disaggregation ...`, ready at /readiness
    NodeGroup([...])                           servers started side by side and stopped together

A node's settings are `ServerArgs` fields (`page_size=16`), written as flags by `settings_flags`;
`flags` adds flags as given. `node_command` and `router_command` are the command lines themselves,
which the cluster (deploy/cluster.py) also shows without starting anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deploy.process import ServerProcess, start_together, stop_all

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


def settings_flags(settings: dict) -> list[str]:
    """{"page_size": 4, "disable_radix_cache": True} -> ["--page-size", "4", "--disable-radix-cache"]
    (None and False values are left out)."""
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


def node_command(role: str, settings: dict, flags: list[str] = ()) -> list[str]:
    """`python -m prefill_node` / `decode_node` with `settings` as flags, then `flags`."""
    return [sys.executable, "-m", f"{role}_node", *settings_flags(settings), *flags]


def router_command(host: str, port: int, prefills: list[tuple[str, int | None]], decodes: list[str],
                   args: list[str] = ()) -> list[str]:
    """The PD router on `host:port` in front of `prefills` ((url, bootstrap port or None)) and
    `decodes` (urls); its /metrics on its own port unless `args` name a --prometheus-port."""
    cmd = [sys.executable, "-m", "router", "--pd-disaggregation", "--host", host, "--port", str(port)]
    for url, bootstrap_port in prefills:
        cmd += ["--prefill", url] + ([] if bootstrap_port is None else [str(bootstrap_port)])
    for url in decodes:
        cmd += ["--decode", url]
    if not any(a.startswith("--prometheus-port") for a in args):
        cmd += ["--prometheus-port", "0"]
    return cmd + list(args)


def node_parser() -> argparse.ArgumentParser:
    """The nodes' flag parser (ServerArgs), to check or read the flags a launcher passes on."""
    from common.config import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


class NodeProcess(ServerProcess):
    """A colocated node: `launch_server(ServerArgs(**settings))`, what `pdserve serve` runs.

        with NodeProcess(model_dir, max_total_tokens=2048) as node:
            requests go to node.url

    Its settings default to `log_level="info"`; a None setting is left out."""

    def __init__(self, model: str, *, name: str = "node", port: int | None = None, env: dict | None = None,
                 log_path: str | Path | None = None, startup_timeout: float = 300.0, netns: str | None = None,
                 cores: list[int] | None = None, echo_command: bool = False, **settings):
        super().__init__(name, port=port, host=settings.get("host", "127.0.0.1"), env=env, log_path=log_path,
                         startup_timeout=startup_timeout, netns=netns, cores=cores, echo_command=echo_command)
        self.settings = {"model": model, "host": self.host, "port": self.port, "log_level": "info",
                         **settings}

    def new_ports(self) -> None:
        super().new_ports()
        self.settings["port"] = self.port

    def command(self) -> list[str]:
        return [sys.executable, "-c", _SERVE_SCRIPT, json.dumps(self.settings)]

    def stats(self) -> dict:
        from deploy.procs import http_json

        return http_json(self.url + "/server_info", timeout=30)["stats"]


class RoleNode(NodeProcess):
    """A prefill or decode node started with `python -m prefill_node` / `python -m decode_node`;
    `flags` come after the settings' flags."""

    def __init__(self, role: str, model: str, *, name: str | None = None, flags: list[str] = (), **settings):
        super().__init__(model, name=name or role, **settings)
        self.role = role
        self.flags = list(flags)

    @property
    def bootstrap_port(self) -> int | None:
        return self.settings.get("disaggregation_bootstrap_port")

    def new_ports(self) -> None:
        super().new_ports()
        if self.bootstrap_port is not None:
            self.settings["disaggregation_bootstrap_port"] = self.pick_port()

    def command(self) -> list[str]:
        return node_command(self.role, self.settings, self.flags)


class RouterProcess(ServerProcess):
    """`python -m router --pd-disaggregation` in front of `prefill` and `decode` workers (anything with
    `url`, and `bootstrap_port` for prefill; `ports` overrides a worker's: a number, "none", or None for
    no port on the command line), ready at /readiness."""

    ready_path = "/readiness"

    def __init__(self, prefill: list, decode: list, *args: str, ports: dict | None = None,
                 name: str = "router", **kw):
        super().__init__(name, **kw)
        self.prefill, self.decode, self.args = list(prefill), list(decode), list(args)
        self.ports = ports or {}

    def command(self) -> list[str]:
        prefills = [(w.url, self.ports.get(w, w.bootstrap_port)) for w in self.prefill]
        return router_command(self.host, self.port, prefills, [w.url for w in self.decode], self.args)


class NodeGroup:
    """Servers started together and stopped together (`launcher.start(NodeGroup([...]))` in the tests)."""

    def __init__(self, nodes: list[ServerProcess]) -> None:
        self.nodes = nodes

    def start(self) -> NodeGroup:
        start_together(self.nodes)
        return self

    def stop(self) -> None:
        stop_all(self.nodes)

    def servers(self) -> list[ServerProcess]:
        return list(self.nodes)
