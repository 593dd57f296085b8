"""The router's worker admin routes (the admin key): list, register, remove, and move a worker between
the pools (`POST /workers/{id}/role`: its node drains and switches its role, router/role_switch.py).
sglang-router's `/workers` shapes; `RouterApp` (router/app.py) mounts `routes()`."""

from __future__ import annotations

from typing import Literal

import msgspec
from aiohttp import web

from common.protocol import BootstrapPort
from common.server.openapi import Route
from router.registry import Registry, RegistryError
from router.retry import error_response
from router.role_switch import DEFAULT_DRAIN_TIMEOUT, MAX_DRAIN_TIMEOUT, RoleSwitcher


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


class WorkerSpec(msgspec.Struct, kw_only=True):
    """Body of `POST /workers` (sglang-router's)."""

    url: str
    worker_type: Literal["prefill", "decode"] = "decode"
    bootstrap_port: BootstrapPort | None = None


class RoleSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of `POST /workers/{id}/role`: the pool to move the worker to (router/role_switch.py)."""

    role: Literal["prefill", "decode"]
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT


class WorkersApi:
    def __init__(self, registry: Registry, switcher: RoleSwitcher, kv_index) -> None:
        self.registry, self.switcher = registry, switcher
        self.kv_index = kv_index  # () -> the router's KVEventIndex (None without --kv-events)

    def routes(self, access) -> list[Route]:
        return [
            Route("GET", "/workers", self.list_workers, access=access, summary="registered workers"),
            Route("POST", "/workers", self.add_worker, WorkerSpec, access=access,
                  summary="register a worker"),
            Route("POST", "/workers/{id:.+}/role", self.switch_worker_role, RoleSpec, access=access,
                  summary="move a worker to the other pool: its node drains and switches its role"),
            Route("DELETE", "/workers/{id:.+}", self.remove_worker, access=access, summary="remove a worker"),
        ]

    async def list_workers(self, request):
        ws = [self._describe(w) for w in self.registry.all()]
        # workers refused as unable to pair with the pool (common/fingerprint.py), with the difference named
        return json_response({"workers": ws, "total": len(ws),
                              "prefill": len(self.registry.prefill), "decode": len(self.registry.decode),
                              "refused": list(self.registry.refused.values())})

    def _describe(self, w) -> dict:
        d = w.describe()
        kv_index = self.kv_index()
        views = kv_index.views_of(w.url) if kv_index is not None else []
        if len(views) == 1:
            d["kv_events"] = views[0].describe()
        elif views:  # a view per DP group
            d["kv_events"] = [v.describe() for v in views]
        return d

    async def add_worker(self, request):
        try:
            spec = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            return error_response(400, f"malformed JSON: {e}")
        if not isinstance(spec, dict):
            return error_response(400, "request body must be a JSON object")
        try:
            ws = msgspec.convert(spec, WorkerSpec)
        except msgspec.ValidationError as e:
            return error_response(400, str(e))
        url, kind, port = ws.url, ws.worker_type, ws.bootstrap_port
        try:
            w = await self.registry.add(url, kind, port,
                                        explicit_none="bootstrap_port" in spec and port is None)
        except RegistryError as e:
            return error_response(e.status, str(e))
        return json_response({"status": "ok", "worker": w.describe()})

    async def switch_worker_role(self, request):
        w = self.registry.find(request.match_info["id"])
        if w is None:
            return error_response(404, f"no worker with id or url {request.match_info['id']!r}")
        try:
            spec = msgspec.json.decode(await request.read(), type=RoleSpec)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return error_response(400, str(e))
        if not 0 <= spec.drain_timeout_s <= MAX_DRAIN_TIMEOUT:
            return error_response(400, f"`drain_timeout_s` must be 0..{MAX_DRAIN_TIMEOUT:.0f}, got "
                                       f"{spec.drain_timeout_s}")
        try:
            done = await self.switcher.switch(w, spec.role, spec.drain_timeout_s)
        except RegistryError as e:
            return error_response(e.status, str(e))
        return json_response({"status": "ok", **done})

    async def remove_worker(self, request):
        try:
            w = self.registry.remove(request.match_info["id"])
        except RegistryError as e:
            return error_response(e.status, str(e))
        return json_response({"status": "ok", "worker": w.describe()})
