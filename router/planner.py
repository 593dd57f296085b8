"""The SLO planner (`--planner slo`): every `--planner-interval-secs` the router looks at its own latency
and its workers' queues, asks the decision rule (router/slo_rule.py) whether a node should move from one
pool to the other, and has an actuator carry the move out.

What one window holds (`Figures`):
* TTFT and ITL p90 of the streamed requests that ended in the last `--planner-window-secs`, as the
  router measured them (router/metrics.py `LatencyWindow`: first byte of the stream, time per streamed
  event after it), and how many requests those are;
* the workers in rotation of each kind: registered and `available` (healthy, breaker not open, not
  `draining`: a worker the role switch is taking out of its pool);
* from each such worker's `/server_info` stats (fetched in parallel with the node key, as the dashboard
  does), the mean over each pool of: on a prefill node the requests waiting for the prefill compute
  (`num_queue_reqs.waiting`; its `bootstrap` stage waits on the decode side's preallocation, which the
  decode node counts, and `inflight` is done computing); on a decode node the requests waiting for a
  decode slot (`waiting`: KV in, running batch full; `prealloc` waits as often on the prefill node's
  bootstrap as on the decode's memory, and `transfer` is KV on its way). A node without those stages counts
  its `num_queued_reqs`. The decode pool's KV headroom is the lowest `1 - num_tokens_used /
  kv_total_tokens` among its workers (free or evictable tokens). Workers that do not answer are left out
  of the means; a pool none of whose workers answered reports 0.

Every decision, a hold included, is logged as one line on the `router.planner` logger,
`planner decision=<action> reason="<sentence>" figures=<json>`, and the last 50 are kept for the
dashboard (`describe()`). A move runs as its own task: windows go on being observed and logged while a
node switches roles or a workload scales, and a move the rule asks for meanwhile is held ("a move is
still under way"), so there is one move at a time. The actuator returns what it did, logged with the
move; when it raises, the failure is logged and counted and the rule is not told (`SloRule.moved`), so
no cooldown starts and the next window may ask again. Nothing a window does stops the loop: an error is
logged and the next window comes.

Actuators (`make_actuator`, by `--planner-actuator`): `switch`, router/role_switch.py's `RoleSwitcher`,
which drains a node of one pool and restarts it in the other role; `k8s`, router/k8s_scale.py's
`DeploymentScaler`, which scales the prefill workload down by one and the decode one up (or the other
way). Both are imported only when chosen.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Protocol

from router import dashboard
from router.slo_rule import DECODE_TO_PREFILL, HOLD, PREFILL_TO_DECODE, Decision, Figures, SloRule

log = logging.getLogger("router.planner")
KEPT = 50  # decisions kept in memory
SHOWN = 20  # of those, the ones describe() returns
ROLES = {PREFILL_TO_DECODE: ("prefill", "decode"), DECODE_TO_PREFILL: ("decode", "prefill")}


class Actuator(Protocol):
    async def move(self, from_role: str, to_role: str) -> dict:
        """Move one node's worth of capacity from `from_role` to `to_role` ("prefill" / "decode"); return
        what was done (say {"worker": url, "seconds": s}); raise when it could not be done."""
        ...


class PlannerError(ValueError):
    """The planner cannot be built as configured."""


def make_actuator(cfg, app_state) -> Actuator:
    """The actuator `--planner-actuator` names; `app_state` is the RouterApp: its `switcher` is the one
    `POST /workers/{id}/role` uses, so both share its one-switch-at-a-time lock."""
    if cfg.planner_actuator == "switch":
        return app_state.switcher
    if cfg.planner_actuator == "k8s":
        from router.k8s_scale import DeploymentScaler  # the kubernetes client is imported at the first move

        return DeploymentScaler(namespace=cfg.planner_k8s_namespace, prefill=cfg.planner_k8s_prefill,
                                decode=cfg.planner_k8s_decode)
    raise PlannerError(f"--planner-actuator must be switch or k8s, got {cfg.planner_actuator!r}")


def _number(v) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _stages(stats: dict, names: tuple[str, ...]) -> float | None:
    """The sum of the named stages of `num_queue_reqs`, when the node reports the first of them; else its
    `num_queued_reqs` (None: neither)."""
    queues = stats.get("num_queue_reqs")
    if isinstance(queues, dict) and _number(queues.get(names[0])) is not None:
        return sum(_number(queues.get(n)) or 0.0 for n in names)
    return _number(stats.get("num_queued_reqs"))


def prefill_waiting(stats: dict) -> float | None:
    """Requests on a prefill node waiting for the compute (bootstrap done, not started)."""
    return _stages(stats, ("waiting",))


def decode_waiting(stats: dict) -> float | None:
    """Requests on a decode node waiting for a decode slot: their KV is in and the running batch is full.
    (Its `prealloc` stage waits as often on the prefill node, whose bootstrap server resolves the room, as
    on its own memory, whose shortage the KV headroom shows.)"""
    return _stages(stats, ("waiting",))


def kv_free(stats: dict) -> float | None:
    total, used = _number(stats.get("kv_total_tokens")), _number(stats.get("num_tokens_used"))
    if not total or used is None:
        return None
    return min(1.0, max(0.0, 1.0 - used / total))


def _mean(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else 0.0


class Planner:
    def __init__(self, cfg, registry, metrics, session, actuator: Actuator, rule: SloRule | None = None):
        self.cfg, self.registry, self.metrics, self.session = cfg, registry, metrics, session
        self.actuator = actuator
        self.rule = rule or SloRule(cfg.ttft_slo, cfg.itl_slo, patience=cfg.planner_patience,
                                    cooldown_s=cfg.planner_cooldown_secs)
        self.decisions: collections.deque = collections.deque(maxlen=KEPT)  # (wall time, Decision)
        self.moves = 0
        self.failures = 0
        self.last_figures: Figures | None = None
        self.last_move: dict | None = None
        self.moving: str | None = None  # the move under way
        self._move_task: asyncio.Task | None = None
        self._task: asyncio.Task | None = None

    # ---------------------------------------------------------------------------- one window

    async def observe(self) -> Figures:
        """The figures of the window that ends now."""
        now = time.monotonic()
        lat = self.metrics.latency.percentiles_since(now - self.cfg.planner_window_secs)
        prefill = [w for w in self.registry.prefill if w.available]
        decode = [w for w in self.registry.decode if w.available]
        stats = await asyncio.gather(*(dashboard.worker_stats(self.session, self.registry.auth, w)
                                       for w in prefill + decode))
        p_stats = [s for s in stats[:len(prefill)] if "error" not in s]
        d_stats = [s for s in stats[len(prefill):] if "error" not in s]
        frees = [x for x in (kv_free(s) for s in d_stats) if x is not None]
        return Figures(ttft_p90=lat["ttft"]["p90"], itl_p90=lat["tpot"]["p90"], requests=lat["n"],
                       num_prefill=len(prefill), num_decode=len(decode),
                       prefill_queue=_mean([prefill_waiting(s) for s in p_stats]),
                       decode_queue=_mean([decode_waiting(s) for s in d_stats]),
                       decode_kv_free=min(frees) if frees else None, at=time.monotonic())

    async def step(self) -> Decision:
        """Observe a window, decide, log it, and start the move it asks for (when none is under way)."""
        f = await self.observe()
        self.last_figures = f
        d = self.rule.decide(f)
        if d.action != HOLD and self.moving is not None:
            d = Decision(HOLD, f"a move is still under way ({self.moving}); the rule asked for {d.action}: "
                               f"{d.reason}", f)
        self.decisions.append((time.time(), d))
        log.info("planner decision=%s reason=%s figures=%s", d.action, json.dumps(d.reason),
                 json.dumps(f.as_dict()))
        if d.action != HOLD:
            self.moving = d.action
            self._move_task = asyncio.get_running_loop().create_task(self._carry_out(d.action))
        return d

    async def _carry_out(self, action: str) -> None:
        src, dst = ROLES[action]
        t0 = time.monotonic()
        try:
            result = await self.actuator.move(src, dst)
        except Exception as e:
            self.failures += 1
            self.last_move = {"action": action, "ok": False, "error": f"{type(e).__name__}: {e}",
                              "time": time.time()}
            log.warning("planner move=%s failed after %.1fs: %s: %s", action, time.monotonic() - t0,
                        type(e).__name__, e, exc_info=True)
            return
        finally:
            self.moving = None
        self.moves += 1
        self.rule.moved(action, time.monotonic())
        self.last_move = {"action": action, "ok": True, "result": result, "time": time.time()}
        log.info("planner move=%s done: %s", action, json.dumps(result, default=str))

    async def settle(self) -> None:
        """Wait for the move under way, if any, to end."""
        task = self._move_task
        if task is not None and not task.done():
            await asyncio.shield(task)

    # ---------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        interval = self.cfg.planner_interval_secs
        log.info("SLO planner on: TTFT p90 <= %gs, ITL p90 <= %gs, a window of %gs every %gs, patience %d, "
                 "cooldown %gs, actuator %s", self.rule.ttft_slo, self.rule.itl_slo,
                 self.cfg.planner_window_secs, interval, self.rule.patience, self.rule.cooldown_s,
                 type(self.actuator).__name__)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("planner window failed; the next one comes in %gs", interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        """Stop the loop and any move under way."""
        tasks = [t for t in (self._task, self._move_task) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._task = None

    def describe(self) -> dict:
        """What the dashboard shows: the SLOs, moves and failures, the move under way, the last one, the
        last decisions (oldest first) and the figures of the last window."""
        return {"enabled": True, "ttft_slo": self.rule.ttft_slo, "itl_slo": self.rule.itl_slo,
                "actuator": self.cfg.planner_actuator, "moves": self.moves, "failures": self.failures,
                "moving": self.moving, "last_move": self.last_move,
                "decisions": [{**d.as_dict(), "time": t} for t, d in list(self.decisions)[-SHOWN:]],
                "last_figures": self.last_figures.as_dict() if self.last_figures is not None else None}
