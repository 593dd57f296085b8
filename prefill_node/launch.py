"""Run a prefill node: the common front end with `PrefillScheduler` (prefill_node/role.py) in every
scheduler process."""

from __future__ import annotations

from common.server.launch import serve_main


def main(argv: list[str]) -> int:
    return serve_main(argv, "prefill")  # its ranks run PrefillScheduler (common/role_rules.py)
