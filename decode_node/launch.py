"""Run a decode node: the common front end with `DecodeScheduler` (decode_node/role.py) in every
scheduler process."""

from __future__ import annotations

from common.server.launch import serve_main


def main(argv: list[str]) -> int:
    return serve_main(argv, "decode")  # its ranks run DecodeScheduler (common/role_rules.py)
