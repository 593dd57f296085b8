"""`pdserve cluster`: a whole PD cluster on this machine with one command.

    pdserve cluster --prefill 2 --decode 2 --transfer-backend fake --model DIR --port 30000

starts N prefill and M decode nodes and the router on `--port` (a `Cluster`, deploy/cluster.py, which
says how), prints the router URL, every child's address and a curl example, then watches its children
until Ctrl-C / SIGTERM, restarting one that exits (`--max-restarts`), and at the signal stops them
cleanly (SIGTERM to each child, SIGKILL of its process group after `--grace-period`; a second Ctrl-C
stops waiting). The children's logs and `cluster.json` are in `--log-dir` (default
`./logs/cluster-<timestamp>`).

By default (`--cpu-affinity auto`) every node gets cores of its own and as many torch threads, and decode
node i borrows prefill node i's cores while that node has nothing to run (`--no-core-loan`: never);
`--cpu-affinity "prefill=0;decode=1"` pins every process of a role to those cores instead (`0-3,6` lists
work; `router=` is accepted too), `--cpu-affinity none` pins nothing. A node's torch threads default to
the cores it may run on divided by its TP size. `--device cuda` (or auto on a machine with GPUs) also
places the nodes on the GPUs of `--gpu-ids`, a GPU set of its own per node or, with fewer GPUs, shared
with `--mem-fraction-static` shares. `--local-prefill-queue` (default 3) turns conditional
disaggregation on, `--hosts` puts every process on a host of its own, `--planner slo --ttft-slo S
--itl-slo S` lets the router move nodes between the pools (their roles switch with the weights kept). The
launcher prints what it chose.

Flags that are not the launcher's own are passed to every node unchanged, checked against the node
parser first, so a typo fails here and not in every node; `--router-args "..."` adds router flags,
checked against the router's parser.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading

from common.models.hub import is_hub_id
from deploy.cluster import DEFAULT_LOCAL_PREFILL_QUEUE, LOCAL_PREFILL_CHUNK, SECRET_ENV, Cluster
from deploy.gpu_placement import plan_from_flags
from deploy.nodes import node_parser
from deploy.procs import ClusterError, parse_affinity


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
      help="KV transfer engine (default nixl, which listens only on --host; mooncake listens on every "
           "interface)")
    a("--model", "--model-path", dest="model", default="default",
      help="model directory, Hugging Face Hub id (owner/name; add --revision R for a branch, tag or commit), "
           ".gguf file or 'default'")
    a("--port", type=int, default=30000, help="router port (0: a free one)")
    a("--host", default="127.0.0.1", help="address every process binds to")
    a("--hosts", action="store_true",
      help="each process on a host of its own: a network namespace with its own address in 10.77.N.0/24 on "
           "a bridge, as on separate machines (needs root; removed on exit)")
    a("--device", default=None, choices=("auto", "cpu", "cuda"),
      help="where the nodes run (default: their own default, auto). cuda, or auto where torch sees a GPU: "
           "each node on GPUs of its own from --gpu-ids, or sharing them with --mem-fraction-static shares "
           "when there are fewer (deploy/gpu_placement.py)")
    a("--gpu-ids", default=None, metavar="IDS",
      help="with --device cuda/auto: the GPUs the nodes may use, e.g. 0,1,2,3, as torch numbers them (after "
           "CUDA_VISIBLE_DEVICES); default: every GPU torch sees")
    a("--tp", type=int, default=None, help="tensor parallel size of every node")
    a("--page-size", type=int, default=None, help="KV page size of every node (default: the node's)")
    a("--chunked-prefill-size", type=int, default=None,
      help="chunked prefill size of every node (default: the node's)")
    a("--cpu-affinity", default="auto", metavar="SPEC",
      help='"auto": cores of its own for every node, as many torch threads (shared round-robin, one thread '
           'each, when there are fewer cores than nodes); "none": no pinning; or pin roles to cores, e.g. '
           '"prefill=0;decode=1" or "prefill=0-1;decode=2-3;router=0"')
    a("--no-core-loan", action="store_true",
      help="with --cpu-affinity auto: decode node i does not borrow prefill node i's cores while that node "
           "has nothing to run (by default it does: common/core_loan.py)")
    a("--local-prefill-queue", type=int, default=None, metavar="N",
      help=f"(default {DEFAULT_LOCAL_PREFILL_QUEUE}; 0 with --planner slo) "
           "conditional disaggregation: the router sends a request to a decode node alone, to prefill it "
           f"there in chunks of {LOCAL_PREFILL_CHUNK} tokens between decode steps, while its prefill node "
           "has N or more prefills in flight per request the decode node is already prefilling itself, plus "
           "one (0: off, every prompt is prefilled on a prefill node). Decode nodes get "
           "--disaggregation-local-prefill, "
           f"--chunked-prefill-size {LOCAL_PREFILL_CHUNK} (given node flags win) and, unless they speculate, "
           "--enable-mixed-chunk (the running requests decode inside each chunk's forward); the router "
           "--local-prefill-queue N")
    a("--planner", default="none", choices=("none", "slo"),
      help="slo: the router moves nodes between the prefill and decode pools to meet --ttft-slo and "
           "--itl-slo (router/planner.py), switching their roles with the weights loaded; every node then "
           "gets a bootstrap port and only flags both roles take (no conditional disaggregation, no core "
           "loan). More planner flags through --router-args")
    a("--ttft-slo", type=float, default=None, metavar="SECS",
      help="with --planner slo: the TTFT target (p90)")
    a("--itl-slo", type=float, default=None, metavar="SECS",
      help="with --planner slo: the time-per-output-token target (p90)")
    a("--policy", default=None, help="router policy (random, round_robin, cache_aware, power_of_two)")
    a("--router-args", default="", help='more router flags, one string: --router-args="--policy random"')
    a("--prefill-args", default="", help='more flags for prefill nodes only: --prefill-args="--tp 2"')
    a("--decode-args", default="",
      help='more flags for decode nodes only: --decode-args="--max-running-requests 8"')
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


def check_flags(flags: list[str], role: str) -> None:
    """Raise ValueError if a flag is not one of `role`'s ("node" or "router"): the child would exit at
    start-up otherwise."""
    from router.cli import build_parser as router_parser

    parser = node_parser() if role == "node" else router_parser()
    try:
        _, unknown = parser.parse_known_args(flags)
    except SystemExit:
        raise ValueError(f"invalid {role} flags: {shlex.join(flags)}") from None
    if unknown:
        command = "serve" if role == "node" else "router"
        raise ValueError(f"not {role} flags: {' '.join(unknown)} (see `pdserve {command} --help`)")


def planner_router_args(ns, local_queue: int) -> list[str]:
    """The router flags of `--planner slo` (both SLOs required; nothing that only one role takes)."""
    for flag, value in (("--ttft-slo", ns.ttft_slo), ("--itl-slo", ns.itl_slo)):
        if value is None or not value > 0:
            raise ValueError(f"--planner slo needs {flag} SECONDS > 0")
    if local_queue > 0:
        raise ValueError("--local-prefill-queue: conditional disaggregation gives decode nodes flags a "
                         "prefill node refuses, so no node could switch; it is off with --planner slo")
    return ["--planner", "slo", "--ttft-slo", str(ns.ttft_slo), "--itl-slo", str(ns.itl_slo)]


def check_both_roles(flags: list[str], role: str) -> None:
    """With the planner a node may take the other role with its flags as they are: they must fit it too."""
    from common.config import ConfigError
    from common.role_rules import rules_for

    other = "decode" if role == "prefill" else "prefill"
    ns, _ = node_parser().parse_known_args(flags)

    def bad(flag: str, why: str) -> ConfigError:
        return ConfigError(f"--{flag}: {why}")

    try:
        rules_for(other).check(ns, bad)
    except ConfigError as e:
        raise ValueError(f"--planner slo: a {role} node may become a {other} node, whose rules refuse its "
                         f"flags: {e}") from None


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
    planner = ns.planner == "slo"
    local_queue = ns.local_prefill_queue
    if local_queue is None:
        local_queue = 0 if planner else DEFAULT_LOCAL_PREFILL_QUEUE
    try:
        for flags in (node_args, prefill_args, decode_args):
            check_flags(flags, "node")
        if planner:
            router_args += planner_router_args(ns, local_queue)
            check_both_roles(node_args + prefill_args, "prefill")
            check_both_roles(node_args + decode_args, "decode")
        elif ns.ttft_slo is not None or ns.itl_slo is not None:
            raise ValueError("--ttft-slo and --itl-slo need --planner slo")
        check_flags(router_args, "router")
        if local_queue < 0:
            raise ValueError(f"--local-prefill-queue must be >= 0 (0: off), got {local_queue}")
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
                   log_dir=ns.log_dir, cpu_affinity=affinity, auto_placement=ns.cpu_affinity == "auto",
                   core_loan=not ns.no_core_loan and not planner, node_args=node_args, gpu_plan=gpu_plan,
                   prefill_args=prefill_args, decode_args=decode_args, router_args=router_args,
                   startup_timeout=ns.startup_timeout, local_prefill_queue=local_queue, switchable=planner,
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
