"""The SLO planner's loop (router/planner.py) on a fake registry, session and actuator (no processes):
the figures it builds from the router's latency window and the workers' /server_info, the move after
`patience` breached windows, the decision log line, one move at a time, a failing actuator; its flags
(router/cli.py) and its dashboard panel's data."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import types

import aiohttp
import pytest

from router import dashboard
from router.cli import build_parser, config_from_args
from router.config import RouterConfig
from router.metrics import LatencyWindow, Metrics
from router.planner import Planner, PlannerError, make_actuator
from router.slo_rule import DECODE_TO_PREFILL, HOLD, SloRule

AUTH = {"Authorization": "Bearer node-key"}


class FakeWorker:
    def __init__(self, url: str, kind: str, available: bool = True, draining: bool = False):
        self.url, self.kind, self.healthy, self.draining = url, kind, available, draining

    @property
    def available(self) -> bool:  # as router/registry.py's Worker: a draining worker is not available
        return self.healthy and not self.draining

    def describe(self) -> dict:
        return {"url": self.url, "worker_type": self.kind}


class FakeRegistry:
    def __init__(self, prefill, decode):
        self.prefill, self.decode, self.auth = prefill, decode, AUTH

    def all(self):
        return self.prefill + self.decode


class FakeResponse:
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    async def read(self) -> bytes:
        return self.body

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class FakeSession:
    """`get(url + "/server_info")` answers the stats set for that worker's URL; a URL without any is
    down (a refused connection)."""

    def __init__(self):
        self.stats: dict[str, dict] = {}
        self.headers: list[dict] = []

    def get(self, url, headers=None, timeout=None):
        self.headers.append(dict(headers or {}))
        base = url.removesuffix("/server_info")
        if base not in self.stats:
            raise aiohttp.ClientConnectionError("refused")
        return FakeResponse(200, json.dumps({"stats": self.stats[base]}).encode())


class FakeActuator:
    def __init__(self, fail: int = 0, gate: asyncio.Event | None = None):
        self.calls: list[tuple[str, str]] = []
        self.fail, self.gate = fail, gate

    async def move(self, from_role: str, to_role: str) -> dict:
        self.calls.append((from_role, to_role))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the node refused the switch")
        return {"worker": f"http://{from_role}-0:1", "seconds": 0.0}


def prefill_stats(waiting: int, bootstrap: int = 0) -> dict:
    return {"num_queue_reqs": {"bootstrap": bootstrap, "waiting": waiting, "inflight": 1},
            "num_queued_reqs": waiting + bootstrap, "kv_total_tokens": 1000, "num_tokens_used": 100}


def decode_stats(prealloc: int, waiting: int, used: int, transfer: int = 0) -> dict:
    return {"num_queue_reqs": {"prealloc": prealloc, "transfer": transfer, "waiting": waiting, "running": 4},
            "num_queued_reqs": prealloc + waiting + transfer, "kv_total_tokens": 1000,
            "num_tokens_used": used}


def cfg(**kw) -> RouterConfig:
    return RouterConfig(planner="slo", ttft_slo=1.0, itl_slo=0.05, planner_interval_secs=0.01, **kw)


def cluster(n_prefill: int = 2, n_decode: int = 3, pq: int = 6, dq: int = 0):
    """A registry of workers all in rotation, their stats, and a latency window with TTFT over its SLO."""
    ps = [FakeWorker(f"http://p{i}:1", "prefill") for i in range(n_prefill)]
    ds = [FakeWorker(f"http://d{i}:1", "decode") for i in range(n_decode)]
    session = FakeSession()
    for w in ps:
        session.stats[w.url] = prefill_stats(pq)
    for w in ds:
        session.stats[w.url] = decode_stats(dq, 0, 200)
    metrics = Metrics()
    for _ in range(20):
        metrics.latency.add(2.0, 0.01)
    return FakeRegistry(ps, ds), metrics, session


def test_figures_from_the_router_and_its_workers():
    ps = [FakeWorker("http://p0:1", "prefill"), FakeWorker("http://p1:1", "prefill"),
          FakeWorker("http://p2:1", "prefill", draining=True), FakeWorker("http://p3:1", "prefill"),
          FakeWorker("http://p4:1", "prefill", available=False)]
    ds = [FakeWorker("http://d0:1", "decode"), FakeWorker("http://d1:1", "decode")]
    session = FakeSession()
    session.stats = {"http://p0:1": prefill_stats(4, bootstrap=9), "http://p1:1": prefill_stats(2),
                     "http://p2:1": prefill_stats(100), "http://p4:1": prefill_stats(100),  # p3 is down
                     "http://d0:1": decode_stats(3, 2, 700, transfer=5),
                     "http://d1:1": decode_stats(0, 1, 250)}
    metrics = Metrics()
    for i in range(10):
        metrics.latency.add(0.1 * (i + 1), 0.01 * (i + 1))
    metrics.latency.samples.appendleft((metrics.latency.samples[0][0] - 120, 50.0, 5.0))  # out of the window
    p = Planner(cfg(), FakeRegistry(ps, ds), metrics, session, FakeActuator())
    f = asyncio.run(p.observe())
    assert (f.num_prefill, f.num_decode, f.requests) == (3, 2, 10)  # draining and unavailable left out
    assert f.prefill_queue == 3.0  # waiting only, (4 + 2) / 2 answering workers
    assert f.decode_queue == 1.5  # waiting only (not prealloc, not transfer): (2 + 1) / 2
    assert f.decode_kv_free == pytest.approx(0.3)  # the lowest of 0.3 and 0.75
    assert f.ttft_p90 == pytest.approx(1.0) and f.itl_p90 == pytest.approx(0.1)
    assert session.headers and all(h == AUTH for h in session.headers)
    assert len(session.headers) == 5  # the workers in rotation only


def test_figures_of_nodes_without_stages_and_of_an_empty_cluster():
    ps, ds = [FakeWorker("http://p0:1", "prefill")], [FakeWorker("http://d0:1", "decode")]
    session = FakeSession()
    session.stats = {"http://p0:1": {"num_queued_reqs": 7}, "http://d0:1": {"num_queued_reqs": 2}}
    p = Planner(cfg(), FakeRegistry(ps, ds), Metrics(), session, FakeActuator())
    f = asyncio.run(p.observe())
    assert (f.prefill_queue, f.decode_queue, f.decode_kv_free) == (7.0, 2.0, None)
    assert (f.ttft_p90, f.itl_p90, f.requests) == (None, None, 0)
    f = asyncio.run(Planner(cfg(), FakeRegistry([], []), Metrics(), FakeSession(), FakeActuator()).observe())
    assert (f.num_prefill, f.num_decode, f.prefill_queue, f.decode_queue) == (0, 0, 0.0, 0.0)


def test_moves_after_patience_windows_and_logs_every_decision(caplog):
    registry, metrics, session = cluster()
    actuator = FakeActuator()
    p = Planner(cfg(planner_patience=2), registry, metrics, session, actuator)

    async def main():
        first = await p.step()
        assert first.action == HOLD and actuator.calls == []
        second = await p.step()
        await p.settle()
        third = await p.step()
        return first, second, third

    with caplog.at_level(logging.INFO, logger="router.planner"):
        first, second, third = asyncio.run(main())
    assert second.action == DECODE_TO_PREFILL and actuator.calls == [("decode", "prefill")]
    assert third.action == HOLD and "for 1 window" in third.reason  # the streak started over
    assert (p.moves, p.failures, p.moving) == (1, 0, None)
    assert p.rule.last_action == DECODE_TO_PREFILL and p.rule.last_move_at is not None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planner decision=")]
    assert len(lines) == 3
    assert lines[1].startswith(f"planner decision={DECODE_TO_PREFILL} reason=\"prefill short")
    figures = json.loads(lines[1].split(" figures=", 1)[1])
    assert figures["ttft_p90"] == 2.0 and figures["prefill_queue"] == 6.0 and figures["num_decode"] == 3
    assert any("planner move=decode_to_prefill done" in r.getMessage() for r in caplog.records)
    d = p.describe()
    assert d["enabled"] and (d["ttft_slo"], d["itl_slo"], d["moves"], d["failures"]) == (1.0, 0.05, 1, 0)
    assert [x["action"] for x in d["decisions"]] == [HOLD, DECODE_TO_PREFILL, HOLD]
    assert d["decisions"][1]["figures"] == figures and d["last_figures"] == third.figures.as_dict()
    assert d["last_move"]["ok"] and d["last_move"]["result"]["worker"] == "http://decode-0:1"
    json.dumps(d)


def test_one_move_at_a_time():
    registry, metrics, session = cluster()

    async def main():
        actuator = FakeActuator(gate=asyncio.Event())
        p = Planner(cfg(), registry, metrics, session, actuator)
        actions = [(await p.step()).action for _ in range(2)]
        await asyncio.sleep(0)
        held = await p.step()
        assert p.describe()["moving"] == DECODE_TO_PREFILL
        actuator.gate.set()
        await p.settle()
        return p, actuator, actions, held

    p, actuator, actions, held = asyncio.run(main())
    assert actions == [HOLD, DECODE_TO_PREFILL]
    assert held.action == HOLD and held.reason.startswith("a move is still under way (decode_to_prefill)")
    assert actuator.calls == [("decode", "prefill")] and p.moves == 1


def test_the_loop_survives_a_failing_actuator_and_a_failing_window(caplog):
    registry, metrics, session = cluster()
    actuator = FakeActuator(fail=1)
    p = Planner(cfg(), registry, metrics, session, actuator, rule=SloRule(1.0, 0.05, patience=1))
    real_observe = p.observe
    broken = {"left": 1}

    async def observe():
        if broken["left"]:
            broken["left"] -= 1
            raise KeyError("a window that breaks")
        return await real_observe()

    p.observe = observe

    async def main():
        p.start()
        for _ in range(500):
            if p.moves:
                break
            await asyncio.sleep(0.01)
        await p.stop()

    with caplog.at_level(logging.INFO, logger="router.planner"):
        asyncio.run(main())
    assert actuator.calls[:2] == [("decode", "prefill")] * 2  # failed, then asked again and done
    assert (p.failures, p.moves) == (1, 1)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("planner window failed") for m in messages)
    assert any("planner move=decode_to_prefill failed" in m and "refused the switch" in m for m in messages)
    assert p._task is None


def test_a_failed_move_is_not_told_to_the_rule():
    registry, metrics, session = cluster()
    p = Planner(cfg(), registry, metrics, session, FakeActuator(fail=5))

    async def main():
        for _ in range(3):
            await p.step()
            await p.settle()

    asyncio.run(main())
    assert p.rule.last_move_at is None and p.rule.last_action is None
    assert (p.moves, p.failures) == (0, 2)  # windows 2 and 3 both asked: no cooldown after a failure
    assert p.describe()["last_move"]["ok"] is False


def test_make_actuator(monkeypatch):
    from router.role_switch import RoleSwitcher

    registry = FakeRegistry([], [])
    app_state = types.SimpleNamespace(registry=registry, session=FakeSession(),
                                      switcher=RoleSwitcher(registry, FakeSession(), cfg()))
    assert make_actuator(cfg(), app_state) is app_state.switcher  # the router's own switcher, with its lock
    seen = {}

    class Scaler:
        def __init__(self, **kw):
            seen.update(kw)

    monkeypatch.setitem(sys.modules, "router.k8s_scale", types.SimpleNamespace(DeploymentScaler=Scaler))
    c = cfg(planner_actuator="k8s", planner_k8s_namespace="ns", planner_k8s_prefill="p",
            planner_k8s_decode="d")
    assert isinstance(make_actuator(c, app_state), Scaler)
    assert seen == {"namespace": "ns", "prefill": "p", "decode": "d"}
    with pytest.raises(PlannerError, match="switch or k8s"):
        make_actuator(cfg(planner_actuator="other"), app_state)


def test_percentiles_since():
    w = LatencyWindow()
    w.samples.extend([(100.0, 9.0, 0.9), (200.0, 1.0, None), (201.0, 2.0, 0.2)])
    got = w.percentiles_since(150.0)
    assert got["n"] == 2 and got["ttft"]["p90"] == 2.0 and got["tpot"]["p90"] == 0.2
    assert w.percentiles_since(300.0) == {"n": 0, "ttft": {"p50": None, "p90": None, "p99": None},
                                          "tpot": {"p50": None, "p90": None, "p99": None}}
    assert set(w.percentiles()) == {"window_s", "n", "ttft", "tpot"}


def test_dashboard_data_has_the_planner():
    registry, metrics, session = cluster(1, 1)
    app = types.SimpleNamespace(registry=registry, metrics=metrics, session=session)
    assert asyncio.run(dashboard.dashboard_data(app))["planner"] == {"enabled": False}
    app.planner = Planner(cfg(), registry, metrics, session, FakeActuator())
    asyncio.run(app.planner.step())
    data = asyncio.run(dashboard.dashboard_data(app))["planner"]
    assert data["enabled"] and data["moves"] == 0 and len(data["decisions"]) == 1
    assert 'id="planner-decisions"' in dashboard.PAGE and "renderPlanner(d.planner" in dashboard.PAGE


def parse(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


SLOS = ("--planner", "slo", "--ttft-slo", "1.5", "--itl-slo", "0.04")


def test_planner_flags():
    c = parse()
    assert (c.planner, c.ttft_slo, c.itl_slo, c.planner_actuator) == ("none", None, None, "switch")
    c = parse(*SLOS, "--planner-interval-secs", "2", "--planner-window-secs", "10", "--planner-patience", "3",
              "--planner-cooldown-secs", "40", "--planner-actuator", "k8s", "--planner-k8s-namespace", "ns",
              "--planner-k8s-prefill", "pre", "--planner-k8s-decode", "dec")
    assert (c.ttft_slo, c.itl_slo, c.planner_interval_secs, c.planner_window_secs) == (1.5, 0.04, 2.0, 10.0)
    assert (c.planner_patience, c.planner_cooldown_secs, c.planner_actuator) == (3, 40.0, "k8s")
    assert (c.planner_k8s_namespace, c.planner_k8s_prefill, c.planner_k8s_decode) == ("ns", "pre", "dec")
    c = parse(*SLOS)
    assert (c.planner_k8s_prefill, c.planner_k8s_decode, c.planner_patience) == ("pdserve-prefill",
                                                                                 "pdserve-decode", 2)


@pytest.mark.parametrize("argv, message", [
    (("--planner", "slo", "--itl-slo", "0.04"), "--planner slo needs --ttft-slo"),
    (("--planner", "slo", "--ttft-slo", "1"), "--planner slo needs --itl-slo"),
    (("--ttft-slo", "1"), "--ttft-slo is refused without --planner slo"),
    (("--planner-patience", "3"), "--planner-patience is refused without --planner slo"),
    ((*SLOS[:3], "0", *SLOS[4:]), "--ttft-slo must be > 0"),
    ((*SLOS[:5], "-0.1"), "--itl-slo must be > 0"),
    ((*SLOS, "--planner-interval-secs", "0"), "--planner-interval-secs must be > 0"),
    ((*SLOS, "--planner-window-secs", "-5"), "--planner-window-secs must be > 0"),
    ((*SLOS, "--planner-cooldown-secs", "0"), "--planner-cooldown-secs must be > 0"),
    ((*SLOS, "--planner-patience", "0"), "--planner-patience must be >= 1"),
    ((*SLOS, "--planner-k8s-decode", "x"), "--planner-k8s-decode is refused without --planner-actuator k8s"),
    ((*SLOS, "--planner-actuator", "k8s", "--planner-k8s-prefill", ""), "--planner-k8s-prefill must not be"),
])
def test_planner_flags_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)
