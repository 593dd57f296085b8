"""`pdserve bench chaos`: a soak under several faults at once; every request must end and nothing leak.

    pdserve bench chaos --duration 1200 --json bench/results/chaos.json      # the long soak
    pdserve bench chaos --requests 300 --hang-wait 20                         # a short one

starts a cluster (deploy/cluster.py: 2 prefill + 2 decode nodes, nixl by default, a tiny
random-weight model by default, restarts on) and drives it through its router, for `--duration`
seconds or `--requests` requests, with at once:

* a closed loop of `--concurrency` clients: chat and completions, streaming and not, prompts of
  5..~300 tokens, 1..`--max-tokens` output tokens;
* client disconnects (`--disconnect-prob`) at a random point: after k stream events, or after a
  random delay for non-streaming requests;
* explicit aborts (`--abort-prob`): a `/generate` stream with its own rid and at least 256 output
  tokens, aborted on every node with `/abort_request` 0-0.5 s after its first token (timed from the
  send, an abort could reach the nodes ahead of a request the router had queued, and be lost);
* injected transfer failures on every node (`--failure-prob`, `DISAGGREGATION_TEST_FAILURE_PROB`);
* a `kill -9` of one decode node and later of one prefill node (their front-end processes, as a
  crash would; the launcher cleans up and restarts them on the same ports);
* bursts (`--burst-size` requests at once every `--burst-every` seconds) past the router's
  admission limits (`--router-args`), which answer 429.

With `--duration` the traffic goes on past it (by at most `--heal-wait` seconds) until every killed
node is healthy again and has been in rotation for `--after-heal` seconds, so the run shows the
router serving through the restarted nodes.

After the run it waits up to `--hang-wait` seconds for every request still open: one without a final
answer by then is *hung*. Then it waits up to `--drain-timeout` for every node to be drained and
reads its leak counters from `/server_info`: free KV tokens (+ evictable) == total, request rows,
preallocation rows and metadata slots all free, no quarantined page, no PD request, open, draining
or pending room, and no more transfer or engine registrations than live peer ranks
(`PDSERVE_PEER_IDLE_TIMEOUT`, `--peer-idle-timeout` here, drops those of dead peers). A node whose
figures are not back by then is *leaked*. RSS (each node's process tree) is taken after the warm-up
and after the drain.

Outcomes per request: completed, error (an HTTP error or an SSE error event; its message is kept,
and an error whose message names no cause is counted apart), rejected (429), disconnected (the
client left), aborted (ended after an explicit abort), hung. `fault_to_error` is the time from a
kill to the error of each request that was open at that moment and failed;
`fault_errors_before_first_token` counts those of them that had received no token, but for those whose
last attempt met an injected transfer failure (the router runs such a request again on another pair, so
it should be 0). `kv_transfer_error_rate` (and its `_stream`
/ `_full` parts) is the share of requests whose client saw "KV transfer failed": the injected failures
the router could not hide.

The parts: bench/chaos_traffic.py is the workload (clients, disconnects, aborts, bursts),
bench/chaos_faults.py the kills, bench/chaos_report.py the drain, the leak counters and the figures;
this file the command line and the run that ties them together.

Output: a progress line every `--progress-every` seconds, a summary line, `--json FILE`. Exit code 0
when no request hung, no node leaked and every node is healthy at the end; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from collections import Counter

from bench.chaos_faults import KillPlan, parse_kills
from bench.chaos_report import drain, report, summary_line, tree_rss
from bench.chaos_traffic import Driver
from bench.report import save_json

NODE_SETTINGS = ["--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "8192",
                 "--max-running-requests", "32", "--num-threads", "1"]
ROUTER_ARGS = ["--policy", "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold",
               "2", "--health-success-threshold", "1", "--max-concurrent-requests", "32", "--queue-size",
               "16", "--queue-timeout-secs", "30"]


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--prefill", type=int, default=2, help="prefill nodes")
    a("--decode", type=int, default=2, help="decode nodes")
    a("--transfer-backend", default="nixl", choices=("nixl", "ucx", "mooncake", "fake"),
      help="KV transfer engine")
    a("--model", default="tiny",
      help="model directory, 'default' (SmolLM2) or 'tiny' (random weights, default)")
    a("--duration", type=float, default=None, help="seconds of traffic (default 120 unless --requests)")
    a("--requests", type=int, default=None, help="requests to send (instead of --duration)")
    a("--concurrency", type=int, default=16, help="closed-loop clients")
    a("--max-tokens", type=int, default=24, help="output tokens per request")
    a("--stream-prob", type=float, default=0.6, help="share of streamed requests")
    a("--disconnect-prob", type=float, default=0.15,
      help="share of requests whose client goes away at a random point")
    a("--abort-prob", type=float, default=0.05, help="share of requests aborted through /abort_request")
    a("--failure-prob", type=float, default=0.2, help="DISAGGREGATION_TEST_FAILURE_PROB on every node")
    a("--burst-every", type=float, default=15.0, help="seconds between bursts")
    a("--burst-size", type=int, default=80, help="requests per burst (0: none)")
    a("--kills", default="decode-1@0.3,prefill-1@0.6",
      help="NAME@FRACTION of the run to kill -9, comma-separated ('' for none)")
    a("--after-heal", type=float, default=5.0,
      help="--duration mode: the run goes on until every killed node has served this long after its restart")
    a("--heal-wait", type=float, default=120.0, help="... for at most this many seconds past --duration")
    a("--warmup", type=int, default=20,
      help="requests before the RSS baseline (no faults but injected failures)")
    a("--hang-wait", type=float, default=60.0, help="seconds after the run a request may still end in")
    a("--drain-timeout", type=float, default=120.0, help="seconds for every node to be back at rest")
    a("--peer-idle-timeout", type=float, default=15.0, help="PDSERVE_PEER_IDLE_TIMEOUT of the nodes")
    a("--heartbeat-interval", type=float, default=0.5, help="PDSERVE_HEARTBEAT_INTERVAL of the nodes")
    a("--progress-every", type=float, default=5.0, help="seconds between progress lines")
    a("--node-args", default="", help="more node flags (default: small pools, one thread)")
    a("--router-args", default="", help="more router flags (default: round robin, 1 s health checks, "
      "32 concurrent requests + a queue of 16)")
    a("--log-dir", default=None, help="children's logs (default: a new temporary folder)")
    a("--seed", type=int, default=0, help="seed of the traffic mix and fault timing")
    a("--json", default=None, help="write the report here")
    return p


def resolve_model(name: str) -> str:
    if name == "tiny":
        from common.models.tiny_model import tiny_model_dir

        return tiny_model_dir()
    if name == "default":
        from common.models.default_model import resolve_model_path

        return resolve_model_path("default")
    return name


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        parse_kills(ns.kills, ns.prefill, ns.decode)
    except ValueError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 2
    if ns.duration is None and ns.requests is None:
        ns.duration = 120.0
    from deploy.cluster import Cluster
    from deploy.procs import ClusterError

    model = resolve_model(ns.model)
    log_dir = ns.log_dir or os.path.join(os.getcwd(), "logs", time.strftime("chaos-%Y%m%d-%H%M%S"))
    env = {"DISAGGREGATION_TEST_FAILURE_PROB": str(ns.failure_prob), "PDSERVE_HEARTBEAT_INTERVAL":
           str(ns.heartbeat_interval), "PDSERVE_PEER_IDLE_TIMEOUT": str(ns.peer_idle_timeout)}
    cluster = Cluster(num_prefill=ns.prefill, num_decode=ns.decode, model=model,
                      transfer_backend=ns.transfer_backend, log_dir=log_dir,
                      node_args=NODE_SETTINGS + shlex.split(ns.node_args),
                      router_args=ROUTER_ARGS + shlex.split(ns.router_args), env=env, quiet=False,
                      restart=True, max_restarts=3, grace_period=10.0)
    print(f"chaos: {ns.prefill} prefill + {ns.decode} decode, {ns.transfer_backend}, model {model}, "
          f"failure prob {ns.failure_prob}, logs {log_dir}", flush=True)
    t0 = time.time()
    try:
        cluster.start()
    except ClusterError as e:
        print(f"chaos: the cluster did not start: {e}", file=sys.stderr)
        return 1
    startup_s = time.time() - t0
    cluster.start_supervisor()
    try:
        report = asyncio.run(soak(ns, cluster))
    finally:
        cluster.stop()
    report["config"]["startup_s"] = round(startup_s, 1)
    report["config"]["model"] = ns.model if ns.model in ("tiny", "default") else model
    report["command"] = "pdserve bench chaos " + shlex.join(sys.argv[3:] if argv is None else argv)
    report["events"] = [{"t": round(t - report["t0"], 2), "child": n, "event": k, "detail": d}
                        for t, n, k, d in cluster.events]
    report.pop("t0")
    f = report["figures"]
    ok = f["hung"] == 0 and f["nodes_leaked"] == 0 and f["nodes_unhealthy"] == 0
    report["ok"] = ok
    line = summary_line(f, ok)
    print(line, flush=True)
    report["summary"] = line
    save_json(ns.json, report)
    return 0 if ok else 1


async def soak(ns, cluster) -> dict:
    """Warm up, run the traffic with its faults, wait for the open requests, drain; the report."""
    import aiohttp

    nodes = [c for c in cluster.children if c.role != "router"]
    driver = Driver(ns, cluster.url, [c.url for c in nodes])
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        # warm-up: every node serves, then the RSS baseline
        warm = [driver.spawn(session, "normal") for _ in range(ns.warmup)]
        await asyncio.gather(*warm)
        rss0 = {c.name: tree_rss(c.proc.pid) for c in nodes}
        warm_outcomes = list(driver.run.outcomes)
        driver.run.outcomes.clear()
        driver.sent = 0

        start = time.time()
        kills = KillPlan(parse_kills(ns.kills, ns.prefill, ns.decode))

        def fraction() -> float:
            if ns.requests is not None:
                return driver.sent / max(ns.requests, 1)
            return (time.time() - start) / ns.duration

        def budget_left() -> int:
            if ns.requests is not None:
                return ns.requests - driver.sent
            elapsed = time.time() - start
            if elapsed < ns.duration or (elapsed < ns.duration + ns.heal_wait and
                                         not kills.healed(cluster, ns.after_heal)):
                return 1 << 30
            return 0

        def on_tick() -> None:
            kills.tick(cluster, fraction(), driver.run.faults, len(driver.run.open))

        last = [time.time()]

        def progress(force: bool = False) -> None:
            now = time.time()
            if not force and now - last[0] < ns.progress_every:
                return
            last[0] = now
            c = Counter(o.result or "open" for o in driver.run.outcomes)
            down = [x.name for x in cluster.children if not x.alive()]
            print(f"chaos: t={now - start:6.1f}s sent {driver.sent} open {len(driver.run.open)} completed "
                  f"{c['completed']} error {c['error']} 429 {c['rejected']} disconnected {c['disconnected']} "
                  f"aborted {c['aborted']}{' down ' + ','.join(down) if down else ''}", flush=True)

        await driver.drive(session, budget_left, progress, on_tick)
        run_end = time.time()
        progress(True)
        # every request still open gets --hang-wait seconds to end
        deadline = run_end + ns.hang_wait
        while driver.run.open and time.time() < deadline:
            await asyncio.sleep(0.1)
            progress()
        hung = [o for o in driver.run.open.values()]
        for t in list(driver.tasks):
            t.cancel()
        await asyncio.gather(*driver.tasks, return_exceptions=True)
        for o in hung:
            o.result = "hung"

    # drain: every node alive, healthy and at rest
    nodes_state, drain_s = await drain(ns, cluster, nodes, rss0)
    return report(ns, driver.run, warm_outcomes, hung, nodes_state, start, run_end, drain_s)


if __name__ == "__main__":
    sys.exit(main())
