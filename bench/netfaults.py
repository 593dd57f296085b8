"""`pdserve bench netfaults`: the cluster across hosts under network faults, on each real transfer backend.

    pdserve bench netfaults --transfer-backend all --phase-secs 40 --json bench/results/netfaults.json

For each backend: a router, 2 prefill and 2 decode hosts, each a network namespace with its own address
(`deploy.cluster.Cluster(hosts=True)`, deploy/netns.py), a tiny random-weight model by default, and one
colocated node on 127.0.0.1 as the reference. Then phases of `--phase-secs` each, under a closed loop of
`--concurrency` clients (bench/chaos_traffic.py's traffic, without disconnects or aborts) and greedy probes
compared token for token with the reference:

    clean                     no fault
    loss                      `netem delay 20ms loss 1%` on both decode hosts where the kernel has netem,
                              else 1 % of their packets dropped both ways (nftables; no delay)
    bandwidth                 both decode hosts' links capped at 20 Mbit/s (tbf)
    partition-decode          decode-1's link down for the first half of the phase, then up
    partition-router-prefill  the router's packets to prefill-0 lost for the first half, then delivered
    clean-after               no fault

Per phase: requests completed, failed and hung, their error causes, probes exact / different / failed,
KV bytes the decode hosts received and at what rate; for a partition, how long the requests open at
the cut took to fail and how long after the heal the host served again. After the run every request
must have ended (else it is hung) and every node must be at rest (bench/chaos_report.py's leak counters), and
no namespace or link may be left behind. The ratios are each faulty phase's completions per second and KV
rate over the same backend's clean phase. Exit 0 when no request hung, no probe differed from the
reference, no node leaked, both partitioned hosts served again and the last, clean phase failed no
request; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import time
from collections import Counter

from bench.chaos import ROUTER_ARGS
from bench.chaos_report import counters, leak_report
from bench.chaos_traffic import Driver, normalize
from bench.report import HelpFormatter, machine_info, save_json

BACKENDS = ("mooncake", "nixl", "ucx")
NODE_SETTINGS = ["--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "8192",
                 "--max-running-requests", "32", "--num-threads", "1", "--stream-keepalive-secs", "1"]
# a silent decode leg fails after 6 s; connects to a cut-off host give up after 3 s
NET_ROUTER_ARGS = ["--stream-idle-timeout-secs", "6", "--worker-connect-timeout-secs", "3",
                   "--health-check-timeout-secs", "2"]
PROBES = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Hello",
          "the quick brown fox jumps over a lazy dog " * 6]
PHASES = ("clean", "loss", "bandwidth", "partition-decode", "partition-router-prefill", "clean-after")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench netfaults", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    a = p.add_argument
    a("--transfer-backend", default="all", help="mooncake, nixl, ucx, or all of them one after another")
    a("--model", default="tiny",
      help="'tiny' (a random-weight model made here), 'default' (SmolLM2) or a path")
    a("--prefill-tp", type=int, default=1, help="TP size of every prefill host (the decode hosts run TP 1)")
    a("--phase-secs", type=float, default=40.0, help="length of each phase")
    a("--concurrency", type=int, default=6, help="clients in the closed loop")
    a("--max-tokens", type=int, default=48, help="most output tokens of a traffic request")
    a("--stream-prob", type=float, default=0.5, help="share of streaming traffic requests")
    a("--hang-wait", type=float, default=60.0, help="seconds an open request may take to end after the run")
    a("--drain-timeout", type=float, default=90.0, help="seconds every node has to come back to rest")
    a("--seed", type=int, default=0, help="seed of the traffic mix")
    a("--log-dir", default=None, help="children's logs (default: ./logs/netfaults-<time>)")
    a("--json", default=None, help="write the report here")
    return p


def traffic_settings(ns) -> argparse.Namespace:
    """What bench/chaos.py's Driver reads: plain traffic, no disconnects, aborts or bursts."""
    return argparse.Namespace(concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                              stream_prob=ns.stream_prob,
                              seed=ns.seed, disconnect_prob=0.0, abort_prob=0.0,
                              burst_size=0, burst_every=1e9)


async def probe(session, url: str, prompt: str) -> tuple[str, str]:
    """("text", answer) or ("error", why) of one greedy completion."""
    import aiohttp

    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=120)) as r:
            out = await r.json(content_type=None)
            if r.status != 200:
                return "error", f"HTTP {r.status}: {out}"
            return "text", out["choices"][0]["text"]
    except Exception as e:  # a fault may end it any way; the reason is kept
        return "error", f"{type(e).__name__}: {e}"


def node_bytes(cluster) -> dict[str, int]:
    from deploy.procs import http_json

    out = {}
    for c in cluster.children:
        if c.role != "router":
            try:
                out[c.name] = int(http_json(c.url + "/server_info",
                                            timeout=5)["stats"].get("transfer_bytes", 0))
            except Exception:
                out[c.name] = -1
    return out


class Faults:
    """The fault of each phase on the cluster's hosts (host 0 is the router, then prefill-0, -1, decode-0,
    -1)."""

    def __init__(self, cluster) -> None:
        self.net = cluster.net
        self.index = {c.name: i + 1 for i, c in enumerate(x for x in cluster.children if x.role != "router")}
        self.decodes = [self.index[c.name] for c in cluster.decodes]
        self.netem = self.net.has_qdisc("netem delay 20ms loss 1%")
        self.router_host = self.net.addrs[0]

    def loss_kind(self) -> str:
        return "netem delay 20ms loss 1%" if self.netem else "nft 1% random drop both ways (no netem here)"

    def start(self, phase: str) -> str | None:
        """Put the phase's fault on; the host whose return is awaited, if any."""
        if phase == "loss":
            for k in self.decodes:
                if self.netem:
                    self.net.shape(k, "netem delay 20ms loss 1%")
                else:
                    self.net.lose(k, 1.0)
        elif phase == "bandwidth":
            for k in self.decodes:
                self.net.shape(k, "tbf rate 20mbit burst 64kb latency 500ms")
        elif phase == "partition-decode":
            self.net.cut(self.index["decode-1"])
            return "decode-1"
        elif phase == "partition-router-prefill":
            self.net.drop(0, self.net.addrs[self.index["prefill-0"]])
            return "prefill-0"
        return None

    def heal(self, phase: str) -> None:
        if phase == "bandwidth" or (phase == "loss" and self.netem):
            for k in self.decodes:
                self.net.shape(k, None)
        elif phase == "loss":
            for k in self.decodes:
                self.net.lose(k, None)
        elif phase == "partition-decode":
            self.net.mend(self.index["decode-1"])
        elif phase == "partition-router-prefill":
            self.net.drop(0, self.net.addrs[self.index["prefill-0"]], undo=True)

    def lost_packets(self) -> int | None:
        return None if self.netem else sum(self.net.lost(k) for k in self.decodes)


async def run_phases(ns, cluster, reference: dict[str, str]) -> tuple[list[dict], int, Driver]:
    """Every phase in turn under the same traffic; then (phases, requests hung, the traffic driver)."""
    import aiohttp

    faults = Faults(cluster)
    driver = Driver(traffic_settings(ns), cluster.url, [])
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) as s:
        phases = [await run_phase(ns, cluster, faults, driver, s, name, reference) for name in PHASES]
        hang_deadline = time.time() + ns.hang_wait
        while driver.run.open and time.time() < hang_deadline:
            await asyncio.sleep(0.2)
        hung = len(driver.run.open)
        for t in list(driver.tasks):
            t.cancel()
        await asyncio.gather(*driver.tasks, return_exceptions=True)
    return phases, hung, driver


async def run_phase(ns, cluster, faults: Faults, driver: Driver, session, name: str,
                    reference: dict[str, str]) -> dict:
    loop = asyncio.get_running_loop()
    start, bytes0, sent0 = time.time(), node_bytes(cluster), len(driver.run.outcomes)
    end = start + ns.phase_secs
    target = faults.start(name)
    healed_at: float | None = None
    served_again: float | None = None
    probes: Counter = Counter()
    differ: list[dict] = []
    print(f"netfaults: {time.strftime('%H:%M:%S')} phase {name}"
          f"{' (' + faults.loss_kind() + ')' if name == 'loss' else ''}", flush=True)

    async def probes_loop() -> None:
        i = 0
        while time.time() < end:
            p = PROBES[i % len(PROBES)]
            kind, text = await probe(session, cluster.url, p)
            if kind == "error":
                probes["failed"] += 1
            elif text == reference[p]:
                probes["exact"] += 1
            else:
                probes["different"] += 1
                differ.append({"prompt": p, "got": text, "want": reference[p]})
            i += 1
            await asyncio.sleep(0.2)

    async def watch_return() -> None:
        """Seconds from the heal until the host's KV byte count moves (it serves again)."""
        nonlocal served_again
        while healed_at is None:
            await asyncio.sleep(0.1)
        before = (await loop.run_in_executor(None, node_bytes, cluster))[target]
        while time.time() < end + 60:
            if (await loop.run_in_executor(None, node_bytes, cluster))[target] > before:
                served_again = time.time() - healed_at
                return
            await asyncio.sleep(0.5)

    def tick() -> None:  # the partition heals half way through the phase
        nonlocal healed_at
        now = time.time()
        if target and healed_at is None and now >= start + ns.phase_secs / 2:
            faults.heal(name)
            healed_at = now
            driver.run.faults.append((now, f"heal {name}"))
            print(f"netfaults: {time.strftime('%H:%M:%S')} healed {name}", flush=True)

    prober = loop.create_task(probes_loop())
    watcher = loop.create_task(watch_return()) if target else None
    if target:
        driver.run.faults.append((start, name))
    await driver.drive(session, lambda: 1 if time.time() < end else 0, lambda *a: None, tick)
    await prober
    if watcher:  # the host serves again within a minute after the phase, under probes
        while not watcher.done():
            await probe(session, cluster.url, PROBES[0])
        await watcher
    lost = faults.lost_packets() if name == "loss" else None
    if not target:
        faults.heal(name)
    bytes1 = node_bytes(cluster)
    outs = driver.run.outcomes[sent0:]
    res = Counter(o.result or "open" for o in outs)
    errors = [o for o in outs if o.result == "error"]
    to_error = [o.ended - start for o in errors if target and o.started <= start <= (o.ended or start)]
    moved = sum(bytes1[n] - bytes0[n] for n in bytes1 if n.startswith("decode"))
    secs = time.time() - start
    phase = {"phase": name, "secs": round(secs, 1), "sent": len(outs), "completed": res["completed"],
             "error": res["error"], "open_at_end": res["open"],
             "error_causes": dict(Counter(normalize(o.message) for o in errors).most_common(8)),
             "probes": dict(probes), "probe_differences": differ[:5],
             "kv_bytes_to_decode": moved, "kv_mb_per_s": round(moved / secs / 1e6, 3),
             "fault_to_error_n": len(to_error),
             "fault_to_error_max_s": round(max(to_error), 2) if to_error else None,
             "served_again_s": round(served_again, 2) if served_again is not None else None}
    if name == "loss":
        phase["loss"] = faults.loss_kind()
        phase["packets_dropped"] = lost
    print(f"netfaults: {name}: sent {phase['sent']} completed {phase['completed']} error {phase['error']} "
          f"probes {dict(probes)} KV {phase['kv_mb_per_s']} MB/s"
          + (f", fault->error max {phase['fault_to_error_max_s']}s, served again after "
             f"{phase['served_again_s']}s" if target else ""), flush=True)
    return phase


def drain(ns, cluster) -> dict[str, dict]:
    """Every node's leak report once it is at rest, or after --drain-timeout."""
    from deploy.procs import http_json

    peers = {"prefill": len(cluster.decodes), "decode": len(cluster.prefills) * ns.prefill_tp}
    deadline = time.time() + ns.drain_timeout
    while True:
        state = {}
        for c in cluster.children:
            if c.role == "router":
                continue
            try:
                s = http_json(c.url + "/server_info")["stats"]
                state[c.name] = {"leaks": leak_report(c.role, s, peers[c.role]), "counters": counters(s)}
            except Exception as e:
                state[c.name] = {"leaks": {"server_info": str(e)}, "counters": {}}
        if all(not v["leaks"] for v in state.values()) or time.time() > deadline:
            return state
        time.sleep(1.0)


def reference_answers(ns, log_dir: str) -> dict[str, str]:
    """Each probe's greedy answer from one colocated node on 127.0.0.1 (stopped again)."""
    from bench.compare import colocated_node

    settings = argparse.Namespace(model=ns.model_path, colocated_threads=1,
                                  node_args=shlex.join(NODE_SETTINGS),
                                  startup_timeout=600.0, omp_wait_policy=None)
    node = colocated_node(settings, list(range(os.cpu_count() or 1)), log_dir).start()
    async def answers() -> dict[str, str]:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            out = {p: await probe(s, node.url, p) for p in PROBES}
        bad = {p: a for p, a in out.items() if a[0] != "text"}
        if bad:
            raise RuntimeError(f"the reference node failed: {bad}")
        return {p: a[1] for p, a in out.items()}

    try:
        return asyncio.run(answers())
    finally:
        node.stop()


def one_backend(ns, backend: str, reference: dict[str, str]) -> dict:
    from deploy.cluster import Cluster

    log_dir = os.path.join(ns.log_dir, backend)
    env = {"PDSERVE_HEARTBEAT_INTERVAL": "0.5", "PDSERVE_TRANSFER_PROTOCOL": "tcp"}
    if backend == "mooncake":  # its listeners take every interface of the namespace (transfer/mooncake.py)
        env["PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN"] = "1"
    tp = ["--tp", str(ns.prefill_tp)] if ns.prefill_tp > 1 else []
    cluster = Cluster(num_prefill=2, num_decode=2, model=ns.model_path, transfer_backend=backend, hosts=True,
                      log_dir=log_dir, node_args=NODE_SETTINGS, prefill_args=tp,
                      router_args=ROUTER_ARGS + NET_ROUTER_ARGS, env=env, quiet=True)
    print(f"netfaults: {backend}: starting router + 2 prefill (TP {ns.prefill_tp}) + 2 decode hosts, "
          f"logs {log_dir}", flush=True)
    t0 = time.time()
    cluster.start()
    net = cluster.net
    try:
        startup = time.time() - t0
        phases, hung, driver = asyncio.run(run_phases(ns, cluster, reference))
        nodes = drain(ns, cluster)
    finally:
        cluster.stop()
    left = net.left_behind()
    partitions = [p for p in phases if p["phase"].startswith("partition")]
    ok = (hung == 0 and not left and all(not v["leaks"] for v in nodes.values())
          and all(p["probes"].get("different", 0) == 0 for p in phases)
          and all(p["served_again_s"] is not None for p in partitions)
          and phases[-1]["error"] == 0)  # healed: the last, clean phase fails nothing
    return {"backend": backend, "ok": ok, "startup_s": round(startup, 1), "hung": hung,
            "left_behind": left, "phases": phases, "nodes": nodes,
            "requests": len(driver.run.outcomes),
            "completed": sum(1 for o in driver.run.outcomes if o.result == "completed")}


def fault_ratios(runs: list[dict]) -> dict[str, float]:
    """Each faulty phase's completions per second and KV rate against its backend's clean phase, in the same
    run (1.0: the fault cost nothing)."""
    out = {}
    for r in runs:
        by = {p["phase"]: p for p in r["phases"]}
        clean = by["clean"]
        for name, p in by.items():
            if name == "clean":
                continue
            for key, fig in (("completed", lambda q: q["completed"] / q["secs"]),
                             ("kv", lambda q: q["kv_mb_per_s"])):
                if fig(clean):
                    out[f"{r['backend']}_{name}_{key}"] = round(fig(p) / fig(clean), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so every cluster stops and its namespaces go
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    from bench.chaos import resolve_model
    from deploy.netns import usable

    why = usable()
    if why is not None:
        print(f"netfaults: cannot make hosts here: {why}", file=sys.stderr)
        return 1
    backends = BACKENDS if ns.transfer_backend == "all" else tuple(ns.transfer_backend.split(","))
    ns.model_path = resolve_model(ns.model)
    ns.log_dir = ns.log_dir or os.path.join(os.getcwd(), "logs", time.strftime("netfaults-%Y%m%d-%H%M%S"))
    os.makedirs(ns.log_dir, exist_ok=True)
    reference = reference_answers(ns, ns.log_dir)
    runs = [one_backend(ns, b, reference) for b in backends]
    ok = all(r["ok"] for r in runs)
    report = {"bench": "netfaults", "machine": machine_info(), "ok": ok,
              "command": "pdserve bench netfaults " + shlex.join(sys.argv[3:] if argv is None else argv),
              "config": {k: v for k, v in vars(ns).items() if k not in ("json", "model_path")},
              "figures": {r["backend"]: r for r in runs}, "ratios": fault_ratios(runs)}
    for r in runs:
        print(f"netfaults: {r['backend']}: {'OK' if r['ok'] else 'FAILED'} {r['completed']}/{r['requests']} "
              f"completed, hung {r['hung']}, leaked nodes "
              f"{sum(1 for v in r['nodes'].values() if v['leaks'])}, probes differing "
              f"{sum(p['probes'].get('different', 0) for p in r['phases'])}", flush=True)
    save_json(ns.json, report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
