"""`POST /switch_role` (the admin key): a prefill node becomes a decode node or back, weights kept.

The body names the new `role` and how long open requests may take to finish (`drain_timeout_s`). The
node's flags are checked for the new role first (the flags a role refuses are refused here too, with
the flag named: 409), then every DP group drains and rebuilds its role
(`TokenizerManager.switch_role`, common/scheduler/role_switch.py). The answer comes once the node
serves the new role: 200 with what the switch did, 409 when it was refused. Meanwhile the node answers
new requests with a 503 naming `role_switch`, which a router sends to another pair. A router that
moves a worker between its pools does it through this route (`POST /workers/{id}/role` on the router,
router/role_switch.py), so it stops routing to the node first and registers it under its new role after.
"""

from __future__ import annotations

import dataclasses
import socket

import msgspec
from aiohttp import web

from common.config import ConfigError
from common.server.http import TM_KEY, error_response, read_json

ROLES = ("prefill", "decode")
MAX_DRAIN_TIMEOUT = 3600.0


class SwitchRoleRequest(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    drain_timeout_s: float = 300.0


def switch_problem(args, role: str) -> str | None:
    """Why this node cannot serve `role` (None: it can)."""
    mode = args.disaggregation_mode
    if mode not in ROLES:
        return f"a {mode} node has no PD role to switch (--disaggregation-mode prefill or decode has one)"
    if getattr(args, "enable_dp_attention", False):
        return "--enable-dp-attention: the DP groups step together and cannot rebuild one at a time"
    try:
        dataclasses.replace(args, disaggregation_mode=role).validate()
    except ConfigError as e:
        return f"the node's flags do not fit the {role} role: {e}"
    if role == "prefill":  # its bootstrap server binds this port: a clash found now, not in the rebuild
        port = args.disaggregation_bootstrap_port
        try:
            with socket.create_server((args.host, port)):
                pass
        except OSError as e:
            return (f"--disaggregation-bootstrap-port {port} cannot be bound on {args.host} ({e.strerror}): "
                    "every node of a host that may become a prefill node needs a port of its own")
    return None


async def handle_switch_role(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    req = await read_json(request, SwitchRoleRequest)
    if req.role not in ROLES:
        return error_response(400, f"`role` must be one of {', '.join(ROLES)}, got {req.role!r}")
    if not 0 <= req.drain_timeout_s <= MAX_DRAIN_TIMEOUT:
        return error_response(400, f"`drain_timeout_s` must be 0..{MAX_DRAIN_TIMEOUT:.0f}, "
                                   f"got {req.drain_timeout_s}")
    if tm.switching is not None:
        return error_response(409, f"a switch to the {tm.switching} role is in progress")
    if req.role == tm.args.disaggregation_mode:
        return web.json_response({"switched": False, "role": req.role, "reason": "already serving it"})
    problem = switch_problem(tm.args, req.role)
    if problem is not None:
        return error_response(409, problem)
    result = await tm.switch_role(req.role, req.drain_timeout_s)
    if not result["switched"]:
        return error_response(409, result["error"])
    return web.json_response(result)
