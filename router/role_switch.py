"""Moving a worker from one pool to the other: the router's side of a node's role switch.

`POST /workers/{id}/role` (the admin key) and the SLO planner (router/planner.py) both go through
`RoleSwitcher.switch`:

1. the worker is marked `draining`: it is no longer `available`, so no new request is routed to it,
   while the requests already there go on;
2. the node is asked to switch (`POST /switch_role` with the router's node key; common/server/
   role_switch_api.py). It hands back what it had not started (503 naming `role_switch`, which the
   retry table runs again on another pair), lets the rest finish, rebuilds its role with its weights
   kept and answers once it serves the new role;
3. the worker leaves its old pool and registers in the new one through the same path as `POST /workers`
   (health, `/server_info`, the pairing check; a new prefill worker's bootstrap port from its
   `/server_info`).

A switch the node refuses (409: its flags do not fit the other role, a switch already running) or that
fails before the node switched leaves the worker where it was, back in rotation. The last available
worker of a pool is never moved: the cluster would stop serving.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import msgspec

from router.registry import DECODE, PREFILL, Registry, RegistryError, Worker

log = logging.getLogger("router.role_switch")

DEFAULT_DRAIN_TIMEOUT = 300.0  # seconds a node's open requests may take to finish
MAX_DRAIN_TIMEOUT = 3600.0
SWITCH_MARGIN = 120.0  # on top of the drain: the rebuild (a GPU captures its graphs again)


class RoleSwitchError(RegistryError):
    """A switch that did not happen (or did on the node, but the worker could not join its new pool)."""


class RoleSwitcher:
    def __init__(self, registry: Registry, session: aiohttp.ClientSession, cfg) -> None:
        self.registry, self.session, self.cfg = registry, session, cfg
        self.lock = asyncio.Lock()  # one switch at a time: each one takes a worker out of rotation
        self.switches = 0
        self.failures = 0

    def pick(self, from_role: str) -> Worker:
        """The worker of `from_role` to move: the available one with the fewest requests in flight."""
        pool = self.registry.prefill if from_role == PREFILL else self.registry.decode
        ready = [w for w in pool if w.available]
        if not ready:
            raise RoleSwitchError(409, f"the {from_role} pool has no available worker")
        return min(ready, key=lambda w: (w.active, w.load or 0))  # `switch` never moves the last one

    async def move(self, from_role: str, to_role: str) -> dict:
        """Move one worker from `from_role`'s pool to `to_role`'s (the planner's actuator)."""
        if {from_role, to_role} != {PREFILL, DECODE}:
            raise RoleSwitchError(400, "a move goes between the prefill and decode pools, not "
                                       f"{from_role} -> {to_role}")
        return await self.switch(self.pick(from_role), to_role)

    async def switch(self, w: Worker, to_role: str, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> dict:
        if to_role not in (PREFILL, DECODE):
            raise RoleSwitchError(400, f"`role` must be 'prefill' or 'decode', got {to_role!r}")
        if w.kind == to_role:
            raise RoleSwitchError(409, f"worker {w.url} already serves the {to_role} role")
        if self.lock.locked():
            raise RoleSwitchError(409, "another role switch is in progress")
        async with self.lock:
            pool = self.registry.prefill if w.kind == PREFILL else self.registry.decode
            if not any(x is not w and x.available for x in pool):
                raise RoleSwitchError(409, f"worker {w.url} is the last available {w.kind} worker")
            start, old = time.monotonic(), w.kind
            log.info("role switch %s worker %s -> %s: draining", old, w.url, to_role)
            w.draining = True
            try:
                node = await self._ask_node(w, to_role, drain_timeout)
            except BaseException:
                w.draining = False
                self.failures += 1
                raise
            self.registry.remove(w.url)
            try:
                new = await self.registry.add(w.url, to_role)
            except RegistryError as e:
                self.failures += 1
                log.error("worker %s switched to %s but could not join the %s pool: %s", w.url, to_role,
                          to_role, e)
                raise RoleSwitchError(502, f"worker {w.url} switched to {to_role} but could not join that "
                                           f"pool: {e}") from None
            self.switches += 1
            seconds = time.monotonic() - start
            log.info("role switch worker %s: %s -> %s in %.2fs (%s requests handed back, %s ended at the "
                     "deadline)", w.url, old, to_role, seconds, node.get("handed_back"),
                     node.get("ended_at_deadline"))
            return {"worker": new.url, "from": old, "to": to_role, "seconds": round(seconds, 3),
                    "handed_back": node.get("handed_back"),
                    "ended_at_deadline": node.get("ended_at_deadline")}

    async def _ask_node(self, w: Worker, to_role: str, drain_timeout: float) -> dict:
        body = msgspec.json.encode({"role": to_role, "drain_timeout_s": drain_timeout})
        headers = {**self.registry.auth, "Content-Type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=drain_timeout + SWITCH_MARGIN)
        try:
            async with self.session.post(w.url + "/switch_role", data=body, headers=headers,
                                         timeout=timeout) as r:
                raw = await r.read()
                status = r.status
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
            raise RoleSwitchError(502, f"worker {w.url}: /switch_role failed: {why}") from None
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            answer = None
        if status != 200 or not isinstance(answer, dict):
            message = answer.get("error", {}).get("message") if isinstance(answer, dict) and \
                isinstance(answer.get("error"), dict) else raw[:300].decode("utf-8", "replace")
            raise RoleSwitchError(409 if status == 409 else 502,
                                  f"worker {w.url} did not switch to {to_role} ({status}): {message}")
        if not answer.get("switched") and answer.get("role") != to_role:  # already serving it: registered
            raise RoleSwitchError(409, f"worker {w.url} did not switch: {answer.get('reason')}")
        return answer
