"""Run a decode node: the common front end with `DecodeScheduler` in every scheduler process."""

from __future__ import annotations

from common.server.launch import serve_main


def main(argv: list[str]) -> int:
    return serve_main(argv, "decode", "decode_node.scheduler:DecodeScheduler")
