"""`pdserve bench chaos`: a soak under several faults at once; every request must end and nothing leak.

    pdserve bench chaos --duration 1200 --json bench/results/chaos.json      # the long soak
    pdserve bench chaos --requests 300 --hang-wait 20                         # a short one

starts a cluster (`deploy.cluster.Cluster`: 2 prefill + 2 decode nodes, nixl by default, a tiny
random-weight model by default, restarts on) and drives it through its router, for `--duration`
seconds or `--requests` requests, with at once:

* a closed loop of `--concurrency` clients: chat and completions, streaming and not, prompts of
  5..~300 tokens, 1..`--max-tokens` output tokens;
* client disconnects (`--disconnect-prob`) at a random point: after k stream events, or after a
  random delay for non-streaming requests;
* explicit aborts (`--abort-prob`): a `/generate` stream with its own rid and at least 256 output
  tokens, aborted on every node with `/abort_request` 0-0.5 s after its first token (timed from the send, an abort could reach the
  nodes ahead of a request the router had queued, and be lost);
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
`fault_errors_before_first_token` counts those of them that had received no token (the router runs
such a request again on another pair, so it should be 0). `kv_transfer_error_rate` (and its `_stream`
/ `_full` parts) is the share of requests whose client saw "KV transfer failed": the injected failures
the router could not hide.

Output: a progress line every `--progress-every` seconds, a summary line, `--json FILE`. Exit code 0
when no request hung, no node leaked and every node is healthy at the end; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import psutil

from bench.report import machine_info, save_json

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers watch the cluster heal "
         "itself after every crash and count each page twice before they go home").split()

NODE_SETTINGS = ["--page-size", "16", "--chunked-prefill-size", "64", "--max-total-tokens", "8192",
                 "--max-running-requests", "32", "--num-threads", "1"]
ROUTER_ARGS = ["--policy", "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--health-success-threshold", "1", "--max-concurrent-requests", "32", "--queue-size", "16",
               "--queue-timeout-secs", "30"]

# a generic message is not a cause: an error must say what failed
VAGUE = re.compile(r"^(internal server error|error|bad gateway|service unavailable|)$", re.I)


@dataclass
class Outcome:
    idx: int
    kind: str  # chat | completions | generate
    stream: bool
    started: float
    plan: str = "normal"  # normal | disconnect | abort | burst
    ended: float | None = None
    result: str = ""  # completed | error | rejected | disconnected | aborted
    status: int = 0
    message: str = ""
    events: int = 0
    events_before_error: int = -1  # stream events the client had when its error came (-1: no error event)


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)  # (time, "kill decode-1")
    open: dict[int, Outcome] = field(default_factory=dict)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 12, 40, 120, 250))))


def normalize(msg: str) -> str:
    """An error message with its numbers, addresses and ids blanked, to count causes."""
    msg = re.sub(r"tcp://[\w.:\[\]-]+|https?://[\w.:\[\]-]+|\d+(\.\d+)?", "#", msg)
    return re.sub(r"\s+", " ", msg)[:160]


def error_text(body) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


class Driver:
    def __init__(self, ns, url: str, node_urls: list[str]) -> None:
        self.ns = ns
        self.url = url
        self.node_urls = node_urls
        self.rng = random.Random(ns.seed)
        self.run = Run()
        self.sent = 0
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ one request
    async def one(self, session, plan: str) -> None:
        ns, rng = self.ns, self.rng
        idx = self.sent
        self.sent += 1
        kind = rng.choice(("chat", "chat", "completions", "generate"))
        if plan == "abort":
            kind = "generate"
        stream = plan != "burst" and (plan == "abort" or rng.random() < ns.stream_prob)
        o = Outcome(idx, kind, stream, time.time(), plan)
        self.run.outcomes.append(o)
        self.run.open[idx] = o
        max_tokens = rng.randint(1, ns.max_tokens)
        if plan == "abort":  # still decoding when its abort comes (0-0.5 s after its first token)
            max_tokens = max(256, ns.max_tokens)
        text = prompt(rng)
        rid = f"chaos-{ns.seed}-{idx}"
        if kind == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                  "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
        elif kind == "completions":
            path, body = "/v1/completions", {"prompt": text, "max_tokens": max_tokens, "stream": stream,
                                             "ignore_eos": True}
        else:
            path, body = "/generate", {"text": text, "rid": rid, "stream": stream,
                                       "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
        stop_after = rng.randint(0, max_tokens) if plan == "disconnect" else None
        on_first = None
        if plan == "abort":  # once its first token is out, so the nodes know the rid when the abort comes
            def on_first():
                abort = asyncio.get_running_loop().create_task(self.abort_later(session, rid, rng.uniform(0, 0.5)))
                self.tasks.add(abort)
                abort.add_done_callback(self.tasks.discard)
        try:
            if plan == "disconnect" and not stream:
                try:
                    await asyncio.wait_for(self.send(session, path, body, o, None), rng.uniform(0.01, 1.5))
                except TimeoutError:
                    o.result = "disconnected"
            else:
                await self.send(session, path, body, o, stop_after, on_first)
        except Exception as e:  # the connection broke: an error that names itself
            if not o.result:
                o.result, o.message = "error", f"client: {type(e).__name__}: {e}"
        finally:
            o.ended = time.time()
            if plan == "abort" and o.result in ("error", "completed") and "abort" in o.message.lower():
                o.result = "aborted"
            elif plan == "abort" and o.result == "error":
                o.result = "aborted"  # ended after its abort with an error answer
            self.run.open.pop(idx, None)

    async def send(self, session, path: str, body: dict, o: Outcome, stop_after: int | None,
                   on_first=None) -> None:
        async with session.post(self.url + path, json=body) as resp:
            o.status = resp.status
            if resp.status == 429:
                o.result = "rejected"
                await resp.read()
                return
            if resp.status != 200:
                raw = await resp.read()
                try:
                    o.message = error_text(json.loads(raw))
                except ValueError:
                    o.message = raw.decode(errors="replace")[:300]
                o.result = "error"
                return
            if not o.stream:
                data = await resp.json(content_type=None)
                if isinstance(data, dict) and "error" in data:
                    o.result, o.message = "error", error_text(data)
                else:
                    o.result = "completed"
                return
            done = False
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event, dict) and "error" in event:
                    o.result, o.message = "error", error_text(event)
                    if o.events_before_error < 0:
                        o.events_before_error = o.events
                o.events += 1
                if o.events == 1 and on_first is not None:
                    on_first()
                if self.aborted_finish(event):
                    o.message = o.message or "finished with reason abort"
                if stop_after is not None and o.events >= stop_after:
                    o.result = "disconnected"
                    return  # leaving the `async with` closes the connection
            if not o.result:
                if done and not o.message:
                    o.result = "completed"
                else:
                    o.result = "error"
                    o.message = o.message or "stream ended without [DONE]"

    @staticmethod
    def aborted_finish(event) -> bool:
        if not isinstance(event, dict):
            return False
        reason = (event.get("meta_info") or {}).get("finish_reason")
        if isinstance(reason, dict):
            return reason.get("type") == "abort"
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
                return True
        return False

    async def abort_later(self, session, rid: str, delay: float) -> None:
        await asyncio.sleep(delay)
        for url in self.node_urls:
            try:
                async with session.post(url + "/abort_request", json={"rid": rid}) as r:
                    await r.read()
            except Exception:  # a node being restarted: the abort reaches the others
                pass

    # ------------------------------------------------------------------ the run
    def spawn(self, session, plan: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(self.one(session, plan))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def pick_plan(self) -> str:
        r = self.rng.random()
        if r < self.ns.disconnect_prob:
            return "disconnect"
        if r < self.ns.disconnect_prob + self.ns.abort_prob:
            return "abort"
        return "normal"

    async def drive(self, session, budget_left, progress, on_tick) -> None:
        ns = self.ns
        loop_clients: set[asyncio.Task] = set()
        next_burst = time.time() + ns.burst_every
        while budget_left():
            while len(loop_clients) < ns.concurrency and budget_left():
                t = self.spawn(session, self.pick_plan())
                loop_clients.add(t)
                t.add_done_callback(loop_clients.discard)
            if ns.burst_size and time.time() >= next_burst and budget_left():
                for _ in range(min(ns.burst_size, max(budget_left(), 0))):
                    self.spawn(session, "burst")
                next_burst = time.time() + ns.burst_every
            on_tick()
            progress()
            await asyncio.sleep(0.02)


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
    for name in ("pd_requests_open", "transfer_rooms_open", "transfer_rooms_draining", "transfer_rooms_pending_info",
                 "num_running_reqs", "num_waiting_reqs"):
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
            "pd_requests_open", "transfer_rooms_open", "transfer_rooms_draining", "transfer_rooms_pending_info",
            "transfer_peers_registered", "transfer_engine_peers", "transfer_peers_watched",
            "control_registrations_expired", "control_peers_open", "transfer_failures", "transfer_aborts",
            "transfer_successes")
    return {k: s[k] for k in keys if k in s}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(round(q * (len(v) - 1))))], 3)


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--prefill", type=int, default=2, help="prefill nodes")
    a("--decode", type=int, default=2, help="decode nodes")
    a("--transfer-backend", default="nixl", choices=("nixl", "ucx", "mooncake", "fake"), help="KV transfer engine")
    a("--model", default="tiny", help="model directory, 'default' (SmolLM2) or 'tiny' (random weights, default)")
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
    a("--warmup", type=int, default=20, help="requests before the RSS baseline (no faults but injected failures)")
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
    cluster = Cluster(num_prefill=ns.prefill, num_decode=ns.decode, model=model, transfer_backend=ns.transfer_backend,
                      log_dir=log_dir, node_args=NODE_SETTINGS + shlex.split(ns.node_args),
                      router_args=ROUTER_ARGS + shlex.split(ns.router_args), env=env, quiet=False, restart=True,
                      max_restarts=3, grace_period=10.0)
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
    line = (f"chaos: {'OK' if ok else 'FAILED'} sent {f['sent']} completed {f['completed']} failed {f['error']} "
            f"(unexplained {f['error_unexplained']}) rejected_429 {f['rejected_429']} disconnected "
            f"{f['disconnected']} aborted {f['aborted']} hung {f['hung']}; fault->error p50 "
            f"{f['fault_to_error_p50_s']}s p99 {f['fault_to_error_p99_s']}s; before a first token at a fault "
            f"{f['fault_errors_before_first_token']}; KV transfer failed {f['kv_transfer_errors']} "
            f"({100 * f['kv_transfer_error_rate']:.2f}%); leaked nodes {f['nodes_leaked']}; "
            f"RSS growth max {f['rss_growth_max']}")
    print(line, flush=True)
    report["summary"] = line
    save_json(ns.json, report)
    return 0 if ok else 1


async def soak(ns, cluster) -> dict:
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
        kills = [[frac, name, False] for frac, name in parse_kills(ns.kills, ns.prefill, ns.decode)]

        def fraction() -> float:
            if ns.requests is not None:
                return driver.sent / max(ns.requests, 1)
            return (time.time() - start) / ns.duration

        def healed_long_enough() -> bool:
            """Every killed node is healthy again and has had `--after-heal` seconds of traffic."""
            killed = {k[1] for k in kills if k[2]}
            if len(killed) < len(kills):
                return False
            healthy = {n: t for t, n, kind, _ in cluster.events if kind == "healthy"}
            return all(n in healthy and time.time() - healthy[n] >= ns.after_heal for n in killed) or \
                any(n in {x.name for x in cluster.children if x.gave_up} for n in killed)

        def budget_left() -> int:
            if ns.requests is not None:
                return ns.requests - driver.sent
            elapsed = time.time() - start
            if elapsed < ns.duration or (elapsed < ns.duration + ns.heal_wait and not healed_long_enough()):
                return 1 << 30
            return 0

        def on_tick() -> None:
            for k in kills:
                if not k[2] and fraction() >= k[0]:
                    k[2] = True
                    c = cluster.child(k[1])
                    if c.alive():
                        os.kill(c.proc.pid, signal.SIGKILL)  # the front end only, as a crash
                        driver.run.faults.append((time.time(), f"kill -9 {k[1]}"))
                        print(f"chaos: {time.strftime('%H:%M:%S')} kill -9 {k[1]} (pid {c.proc.pid}) with "
                              f"{len(driver.run.open)} requests open", flush=True)

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
    from deploy.procs import http_json, http_status

    drain_start = time.time()
    peers = {"prefill": len(cluster.decodes), "decode": len(cluster.prefills)}
    tp = 1
    nodes_state: dict[str, dict] = {}
    while True:
        nodes_state = {}
        for c in nodes:
            entry: dict = {"healthy": c.alive() and http_status(c.url + "/health") == 200,
                           "restarts": len(c.restarts)}
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
        if e["rss_end_mb"] and rss0[c.name] and not c.restarts:
            e["rss_growth"] = round(e["rss_end_mb"] / e["rss_start_mb"] - 1, 4)

    outs = driver.run.outcomes
    res = Counter(o.result for o in outs)
    errors = [o for o in outs if o.result == "error"]
    unexplained = [o for o in errors if VAGUE.match(o.message.strip())]
    fault_to_error = []
    for ft, _ in driver.run.faults:
        for o in errors:
            if o.started <= ft <= (o.ended or ft):
                fault_to_error.append(o.ended - ft)
    # requests open at a kill that failed before any token reached their client (a non-streaming one
    # receives nothing before its answer): the router should have run them again on another pair
    untouched_at_fault = {o.idx for ft, _ in driver.run.faults for o in errors
                          if o.started <= ft <= (o.ended or ft) and (not o.stream or o.events_before_error == 0)}
    kv_errors = [o for o in errors if "KV transfer failed" in o.message]
    n_stream = sum(1 for o in outs if o.stream)
    error_latency = [o.ended - o.started for o in errors]
    causes = Counter(normalize(o.message) for o in errors)
    growths = [e["rss_growth"] for e in nodes_state.values() if "rss_growth" in e]
    figures = {
        "sent": len(outs), "completed": res["completed"], "error": res["error"],
        "error_unexplained": len(unexplained), "rejected_429": res["rejected"], "disconnected": res["disconnected"],
        "aborted": res["aborted"], "hung": res["hung"],
        "fault_to_error_n": len(fault_to_error), "fault_to_error_p50_s": percentile(fault_to_error, 0.5),
        "fault_to_error_p99_s": percentile(fault_to_error, 0.99),
        "fault_errors_before_first_token": len(untouched_at_fault),
        "kv_transfer_errors": len(kv_errors),
        "kv_transfer_error_rate": round(len(kv_errors) / max(len(outs), 1), 5),
        "kv_transfer_error_rate_stream": round(sum(1 for o in kv_errors if o.stream) / max(n_stream, 1), 5),
        "kv_transfer_error_rate_full": round(sum(1 for o in kv_errors if not o.stream)
                                             / max(len(outs) - n_stream, 1), 5),
        "error_latency_p50_s": percentile(error_latency, 0.5), "error_latency_p99_s": percentile(error_latency, 0.99),
        "completed_latency_p50_s": percentile([o.ended - o.started for o in outs if o.result == "completed"], 0.5),
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
            "unexplained_errors": [{"status": o.status, "message": o.message, "kind": o.kind, "stream": o.stream}
                                   for o in unexplained[:20]],
            "hung_requests": [{"idx": o.idx, "kind": o.kind, "stream": o.stream, "plan": o.plan,
                               "started_s": round(o.started - start, 2)} for o in hung[:50]],
            "faults": [{"t": round(t - start, 2), "what": w} for t, w in driver.run.faults],
            "nodes": nodes_state}


if __name__ == "__main__":
    sys.exit(main())
