"""What `pdserve bench chaos` (bench/chaos.py) reads and reports after its run: every node drained
and its leak counters, each node's RSS, and the figures of the run.

A node is *leaked* when, after the drain, a figure of its `/server_info` is not back at rest
(`leak_report`): free KV tokens (+ evictable) == total, request rows, preallocation rows and metadata
slots all free, no quarantined page, no PD request, open, draining or pending room, and no more
transfer or engine registrations than live peer ranks. RSS is a node's whole process tree, taken
after the warm-up and after the drain; a restarted node's growth is not counted.

`report` turns the outcomes into the figures: counts per result, the time from each kill to the error
of every request that was open then and failed (and how many of those had no token yet: the router
should have run them again), the share of "KV transfer failed" answers, latencies, and the causes of
the errors with their numbers blanked (bench/chaos_traffic.py `normalize`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter

import psutil

from bench.chaos_traffic import VAGUE, Outcome, Run, normalize
from bench.report import machine_info


def tree_rss(pid: int) -> int:
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def leak_report(role: str, s: dict, peers_alive: int) -> dict:
    """The figures of a node that are not back at rest: {figure: [now, expected]}."""
    out: dict[str, list] = {}

    def want(name: str, now, expected) -> None:
        if now is not None and expected is not None and now != expected:
            out[name] = [now, expected]

    want("kv_free_tokens+evictable", s.get("kv_free_tokens", 0) + s.get("kv_evictable_tokens", 0),
         s.get("kv_total_tokens"))
    want("req_rows_free", s.get("req_rows_free"), s.get("req_rows_total"))
    want("metadata_slots_free", s.get("metadata_slots_free"), s.get("metadata_slots_total"))
    if role == "decode":
        want("prealloc_slots_free", s.get("prealloc_slots_free"), s.get("prealloc_slots_total"))
        want("kv_quarantined_pages", s.get("kv_quarantined_pages"), 0)
    for name in ("pd_requests_open", "transfer_rooms_open", "transfer_rooms_draining",
                 "transfer_rooms_pending_info", "num_running_reqs", "num_waiting_reqs"):
        want(name, s.get(name), 0)
    queues = s.get("num_queue_reqs") or {}
    if isinstance(queues, dict) and sum(queues.values()):
        out["queues"] = [queues, 0]
    for name in ("transfer_peers_registered", "transfer_engine_peers"):
        if s.get(name) is not None and s[name] > peers_alive:
            out[name] = [s[name], f"<= {peers_alive}"]
    return out


def counters(s: dict) -> dict:
    keys = ("kv_free_tokens", "kv_evictable_tokens", "kv_total_tokens", "req_rows_free", "req_rows_total",
            "req_slots_free", "req_slots_total", "prealloc_slots_free", "prealloc_slots_total",
            "metadata_slots_free", "metadata_slots_total", "kv_quarantined_pages", "kv_quarantined_rooms",
            "pd_requests_open", "transfer_rooms_open", "transfer_rooms_draining",
            "transfer_rooms_pending_info",
            "transfer_peers_registered", "transfer_engine_peers", "transfer_peers_watched",
            "control_registrations_expired", "control_peers_open", "transfer_failures", "transfer_aborts",
            "transfer_successes")
    return {k: s[k] for k in keys if k in s}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(round(q * (len(v) - 1))))], 3)


async def drain(ns, cluster, nodes: list, rss0: dict[str, int]) -> tuple[dict[str, dict], float]:
    """Wait up to `--drain-timeout` until every node is alive, healthy and at rest; returns each node's
    state (health, restarts, counters, leaks, RSS) and the seconds it took."""
    from deploy.procs import http_json, http_status

    drain_start = time.time()
    peers = {"prefill": len(cluster.decodes), "decode": len(cluster.prefills)}
    tp = 1
    nodes_state: dict[str, dict] = {}
    while True:
        nodes_state = {}
        for c in nodes:
            entry: dict = {"healthy": c.alive() and http_status(c.url + "/health") == 200,
                           "restarts": len(cluster.supervisor.record(c).restarts)}
            try:
                stats = http_json(c.url + "/server_info")["stats"]
                entry["counters"] = counters(stats)
                entry["leaks"] = leak_report(c.role, stats, peers[c.role] * tp)
            except Exception as e:
                entry["counters"], entry["leaks"] = {}, {"server_info": str(e)}
            nodes_state[c.name] = entry
        if all(e["healthy"] and not e["leaks"] for e in nodes_state.values()) or \
                time.time() - drain_start > ns.drain_timeout:
            break
        await asyncio.sleep(1.0)
    drain_s = time.time() - drain_start
    for c in nodes:
        e = nodes_state[c.name]
        e["rss_start_mb"] = round(rss0[c.name] / 2**20, 1)
        e["rss_end_mb"] = round(tree_rss(c.proc.pid) / 2**20, 1) if c.alive() else None
        if e["rss_end_mb"] and rss0[c.name] and not e["restarts"]:
            e["rss_growth"] = round(e["rss_end_mb"] / e["rss_start_mb"] - 1, 4)
    return nodes_state, drain_s


def report(ns, run: Run, warm_outcomes: list[Outcome], hung: list[Outcome], nodes_state: dict[str, dict],
           start: float, run_end: float, drain_s: float) -> dict:
    """The bench's JSON report of one run (`t0`: the run's start, for the caller's event times)."""
    outs = run.outcomes
    res = Counter(o.result for o in outs)
    errors = [o for o in outs if o.result == "error"]
    unexplained = [o for o in errors if VAGUE.match(o.message.strip())]
    fault_to_error = []
    for ft, _ in run.faults:
        for o in errors:
            if o.started <= ft <= (o.ended or ft):
                fault_to_error.append(o.ended - ft)
    kv_errors = [o for o in errors if "KV transfer failed" in o.message]
    # requests open at a kill that failed before any token reached their client (a non-streaming one
    # receives nothing before its answer): the router should have run them again on another pair. One
    # whose last attempt ended in an injected transfer failure is the injection's (kv_transfer_errors),
    # not the kill's: every attempt it had left met one
    untouched_at_fault = {o.idx for ft, _ in run.faults for o in errors
                          if o.started <= ft <= (o.ended or ft) and "KV transfer failed" not in o.message
                          and (not o.stream or o.events_before_error == 0)}
    n_stream = sum(1 for o in outs if o.stream)
    error_latency = [o.ended - o.started for o in errors]
    causes = Counter(normalize(o.message) for o in errors)
    growths = [e["rss_growth"] for e in nodes_state.values() if "rss_growth" in e]
    figures = {
        "sent": len(outs), "completed": res["completed"], "error": res["error"],
        "error_unexplained": len(unexplained), "rejected_429": res["rejected"],
        "disconnected": res["disconnected"],
        "aborted": res["aborted"], "hung": res["hung"],
        "fault_to_error_n": len(fault_to_error), "fault_to_error_p50_s": percentile(fault_to_error, 0.5),
        "fault_to_error_p99_s": percentile(fault_to_error, 0.99),
        "fault_errors_before_first_token": len(untouched_at_fault),
        "kv_transfer_errors": len(kv_errors),
        "kv_transfer_error_rate": round(len(kv_errors) / max(len(outs), 1), 5),
        "kv_transfer_error_rate_stream": round(sum(1 for o in kv_errors if o.stream) / max(n_stream, 1), 5),
        "kv_transfer_error_rate_full": round(sum(1 for o in kv_errors if not o.stream)
                                             / max(len(outs) - n_stream, 1), 5),
        "error_latency_p50_s": percentile(error_latency, 0.5),
        "error_latency_p99_s": percentile(error_latency, 0.99),
        "completed_latency_p50_s": percentile([o.ended - o.started for o in outs if o.result == "completed"],
                                              0.5),
        "run_s": round(run_end - start, 1), "drain_s": round(drain_s, 1),
        "requests_per_s": round(len(outs) / max(run_end - start, 1e-3), 2),
        "nodes_leaked": sum(1 for e in nodes_state.values() if e["leaks"]),
        "nodes_unhealthy": sum(1 for e in nodes_state.values() if not e["healthy"]),
        "rss_growth_max": max(growths) if growths else None,
        "rss_growth_mean": round(statistics.mean(growths), 4) if growths else None,
        "warmup_completed": sum(1 for o in warm_outcomes if o.result == "completed"),
    }
    return {"bench": "chaos", "t0": start, "machine": machine_info(),
            "config": {k: v for k, v in vars(ns).items() if k != "json"},
            "figures": figures, "ratios": {},
            "error_causes": dict(causes.most_common(25)),
            "unexplained_errors": [{"status": o.status, "message": o.message, "kind": o.kind,
                                    "stream": o.stream} for o in unexplained[:20]],
            "hung_requests": [{"idx": o.idx, "kind": o.kind, "stream": o.stream, "plan": o.plan,
                               "started_s": round(o.started - start, 2)} for o in hung[:50]],
            "faults": [{"t": round(t - start, 2), "what": w} for t, w in run.faults],
            "nodes": nodes_state}


def summary_line(f: dict, ok: bool) -> str:
    """The one line the bench prints at its end, from the report's figures."""
    return (f"chaos: {'OK' if ok else 'FAILED'} sent {f['sent']} completed {f['completed']} "
            f"failed {f['error']} (unexplained {f['error_unexplained']}) rejected_429 {f['rejected_429']} "
            f"disconnected {f['disconnected']} aborted {f['aborted']} hung {f['hung']}; fault->error p50 "
            f"{f['fault_to_error_p50_s']}s p99 {f['fault_to_error_p99_s']}s; before a first token at a fault "
            f"{f['fault_errors_before_first_token']}; KV transfer failed {f['kv_transfer_errors']} "
            f"({100 * f['kv_transfer_error_rate']:.2f}%); leaked nodes {f['nodes_leaked']}; "
            f"RSS growth max {f['rss_growth_max']}")
