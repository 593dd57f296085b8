"""The fault plan of `pdserve bench chaos` (bench/chaos.py): which nodes are killed when, and when the
cluster has healed.

`--kills decode-1@0.3,prefill-1@0.6` kills decode-1 once 30 % of the run is done and prefill-1 at 60 %
(of `--duration`, or of `--requests` sent). A kill is a `kill -9` of the node's front-end process only,
as a crash would leave it: its scheduler processes are left for the launcher to clean up before it
restarts the node on the same ports (deploy/supervise.py). The other faults of the run are the
workload's (bench/chaos_traffic.py) and the nodes' injected transfer failures.
"""

from __future__ import annotations

import os
import signal
import time


def parse_kills(spec: str, prefill: int, decode: int) -> list[tuple[float, str]]:
    """`--kills` as (fraction of the run, node name); a name the cluster does not have, or a fraction outside
    0..1, raises ValueError naming it."""
    names = {f"prefill-{i}" for i in range(prefill)} | {f"decode-{i}" for i in range(decode)}
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, frac = item.partition("@")
        if name not in names:
            raise ValueError(f"--kills: no node {name!r} in this cluster (it has {', '.join(sorted(names))})")
        try:
            at = float(frac or 0.5)
        except ValueError:
            raise ValueError(f"--kills: {item!r} needs NAME@FRACTION, e.g. decode-0@0.3") from None
        if not 0 <= at <= 1:
            raise ValueError(f"--kills: fraction {at} of {name} is outside 0..1")
        out.append((at, name))
    return out


class KillPlan:
    """The kills of one run, each done once when the run reaches its fraction."""

    def __init__(self, kills: list[tuple[float, str]]) -> None:
        self.pending = list(kills)
        self.done: list[str] = []

    def tick(self, cluster, fraction: float, faults: list[tuple[float, str]], open_requests: int) -> None:
        """Kill every node whose fraction of the run has come (its front end only, as a crash), noting
        the kill in `faults`."""
        for at, name in list(self.pending):
            if fraction < at:
                continue
            self.pending.remove((at, name))
            self.done.append(name)
            c = cluster.child(name)
            if c.alive():
                os.kill(c.proc.pid, signal.SIGKILL)
                faults.append((time.time(), f"kill -9 {name}"))
                print(f"chaos: {time.strftime('%H:%M:%S')} kill -9 {name} (pid {c.proc.pid}) with "
                      f"{open_requests} requests open", flush=True)

    def healed(self, cluster, after_heal: float) -> bool:
        """Every kill is done and every killed node is healthy again and has had `after_heal` seconds of
        traffic since (or the launcher gave up on one)."""
        if self.pending:
            return False
        healthy = {n: t for t, n, kind, _ in cluster.events if kind == "healthy"}
        return all(n in healthy and time.time() - healthy[n] >= after_heal for n in self.done) or \
            any(cluster.supervisor.gave_up(n) for n in self.done)
