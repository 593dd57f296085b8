"""`pdserve`: one console script, one subcommand per deployable part.

Each subcommand imports its part lazily, so `pdserve router` never loads torch.
"""

from __future__ import annotations

import argparse
import sys


def _serve(argv: list[str]) -> int:
    from common.server.launch import serve_main

    return serve_main(argv)


def _prefill(argv: list[str]) -> int:
    from prefill_node.launch import main

    return main(argv)


def _decode(argv: list[str]) -> int:
    from decode_node.launch import main

    return main(argv)


def _router(argv: list[str]) -> int:
    from router.cli import main

    return main(argv) or 0


def _cluster(argv: list[str]) -> int:
    from deploy.cluster_cli import main

    return main(argv) or 0


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve convert",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="convert the default model (or a GGUF file) into a "
                                     "safetensors directory in the cache")
    parser.add_argument("gguf", nargs="?", default="default", help="a .gguf file, or 'default'")
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    return parser


def _convert(argv: list[str]) -> int:
    ns = convert_parser().parse_args(argv)
    from common.models.default_model import convert_gguf, resolve_model_path

    out = convert_gguf(ns.gguf, ns.out) if ns.out else resolve_model_path(ns.gguf)
    print(out)
    return 0


BENCHES = {
    "engine": "bench.engine",
    "kernels": "bench.kernels",
    "moe": "bench.moe",
    "transfer": "bench.transfer",
    "router": "bench.router",
    "serve": "bench.serve",
    "compare": "bench.compare",
    "placement": "bench.placement",
    "dp": "bench.dp",
    "dp-attention": "bench.dp_attention",
    "planner": "bench.planner",
    "pp": "bench.pp",
    "quant": "bench.quant",
    "kv_routing": "bench.kv_routing",
    "retract": "bench.retract",
    "chaos": "bench.chaos",
    "netfaults": "bench.netfaults",
    "startup": "bench.startup",
    "clients": "bench.clients.run",
    "gpu": "bench.gpu.run",
    "gpu-pd": "bench.gpu.pd",
}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print(f"usage: pdserve bench {{{'|'.join(BENCHES)}}} [options] [--json FILE]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    # a bench's main returns an exit code, or its results (a dict: success) -- never sys.exit(dict)
    rc = importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
    return rc if isinstance(rc, int) else 0


COMMANDS = {
    "serve": ("one colocated node (prefill + decode in one engine)", _serve),
    "prefill": ("a prefill node with its bootstrap server (PD disaggregation)", _prefill),
    "decode": ("a decode node (PD disaggregation)", _decode),
    "router": ("the PD router (sglang-router's flags)", _router),
    "cluster": ("N prefill + M decode nodes and the router on this machine", _cluster),
    "bench": ("benchmarks: " + ", ".join(BENCHES), _bench),
    "convert": ("the default model (or a GGUF) into a safetensors directory", _convert),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        from common.version import VERSION

        print(f"pdserve {VERSION}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: pdserve <command> [options]   (pdserve --version: the version)\n\ncommands:")
        for name, (help_, _) in COMMANDS.items():
            print(f"  {name:<10} {help_}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]][1](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
