"""`pdserve bench router`: this router against sglang-router (Rust, from PyPI) in PD mode, same recording
workers, same load, one run. Reports requests/s, p50/p99 latency and the router's CPU seconds per request
(user+sys of the router process, threads included) at each concurrency, and the ratios.

The stand-ins (tests/router/workers.py) and both routers are deploy's processes (deploy/process.py,
deploy/nodes.py's `RouterProcess` with sglang-router's module swapped in), each with this run's log in
`--log-dir` (`prefill-0.log`, `decode-1.log`, `ours.log`, `sglang_router.log`)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from bench.report import write_report
from deploy.nodes import RouterProcess
from deploy.process import ServerProcess, start_together, stop_all
from deploy.procs import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER_SCRIPT = REPO / "tests" / "router" / "workers.py"
MINI_LB_CPU_MS = 2.9  # SGLang's Python mini load balancer, CPU ms per request (figure quoted in the issue)


def fresh_log(log_dir: Path, name: str) -> Path:
    """`<log_dir>/<name>.log`, without what an earlier run wrote there (the folder is the same every run)."""
    path = log_dir / f"{name}.log"
    path.unlink(missing_ok=True)
    return path


class StandIn(ServerProcess):
    """A recording stand-in for a prefill or decode node (tests/router/workers.py), keeping nothing."""

    def __init__(self, role: str, bootstrap_port: int | None, log_dir: Path, index: int):
        name = f"{role}-{index}"
        super().__init__(name, log_path=fresh_log(log_dir, name), startup_timeout=60.0)
        self.role, self.bootstrap_port = role, bootstrap_port

    def command(self) -> list[str]:
        cmd = [sys.executable, str(WORKER_SCRIPT), "--port", str(self.port), "--role", self.role]
        boot = [] if self.bootstrap_port is None else ["--bootstrap-port", str(self.bootstrap_port)]
        return cmd + boot + ["--no-record"]


def stand_ins(n_prefill: int, n_decode: int, log_dir: Path) -> tuple[list[StandIn], list[StandIn]]:
    """The prefill stand-ins (bootstrap ports 8998, 8999, ...: they only report them) and the decode ones."""
    prefill = [StandIn("prefill", 8998 + i, log_dir, i) for i in range(n_prefill)]
    decode = [StandIn("decode", None, log_dir, i) for i in range(n_decode)]
    return prefill, decode


class Router(RouterProcess):
    """Ours (`python -m router`) or sglang-router (`python -m sglang_router.launch_router`) with the same
    flags in front of the same stand-ins, its metrics on a port of its own; ready at /health, as both are."""

    ready_path = "/health"

    def __init__(self, kind: str, prefill: list[StandIn], decode: list[StandIn], policy: str, log_dir: Path):
        super().__init__(prefill, decode, "--policy", policy, "--prometheus-host", "127.0.0.1",
                         "--prometheus-port", str(free_port()), name=kind, log_path=fresh_log(log_dir, kind),
                         startup_timeout=60.0)
        self.module = "router" if kind == "ours" else "sglang_router.launch_router"

    def command(self) -> list[str]:
        python, _, _, *flags = super().command()  # python -m router <flags>
        return [python, "-m", self.module, *flags]


async def serves_a_request(router: Router) -> None:
    """Wait until a request goes through the router end to end."""
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.post(router.url + "/generate", json={"text": "warm up"}) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline or not router.alive():
                raise RuntimeError(f"router {router.url} never served a request")
            await asyncio.sleep(0.2)


BODY = (b'{"text": "The quick brown fox jumps over the lazy dog. Tell me a story about it.", '
        b'"sampling_params": {"max_new_tokens": 16, "temperature": 0}}')


async def load(url: str, n: int, concurrency: int) -> tuple[list[float], int, float]:
    """n requests from `concurrency` closed-loop clients; returns (latencies, errors, wall seconds)."""
    lat: list[float] = []
    errors = 0
    remaining = n
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def client():
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/generate", data=BODY,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, OSError):
                    ok = False
                lat.append(time.perf_counter() - t0)
                errors += not ok

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return lat, errors, wall


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def measure(url: str, pid: int, n: int, concurrency: int) -> dict:
    p = psutil.Process(pid)
    await load(url, min(n // 5, 500), concurrency)  # warm-up
    c0 = cpu_seconds(p)
    lat, errors, wall = await load(url, n, concurrency)
    cpu = cpu_seconds(p) - c0
    lat.sort()
    return {"requests": n, "errors": errors, "wall_s": round(wall, 3), "rps": round(n / wall, 1),
            "p50_ms": round(statistics.median(lat) * 1e3, 2),
            "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 2),
            "cpu_ms_per_req": round(cpu / n * 1e3, 4)}


async def run(args) -> dict:
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    prefill, decode = stand_ins(args.prefill_workers, args.decode_workers, log_dir)
    routers = {kind: Router(kind, prefill, decode, args.policy, log_dir)
               for kind in ("ours", "sglang_router")}
    try:
        start_together(prefill + decode)
        start_together(list(routers.values()))
        for router in routers.values():
            await serves_a_request(router)
        results: dict[str, dict] = {"ours": {}, "sglang_router": {}}
        for c in args.concurrency:
            for kind in ("sglang_router", "ours"):
                router = routers[kind]
                r = await measure(router.url, router.proc.pid, args.requests, c)
                results[kind][f"c{c}"] = r
                print(f"{kind:>14} c={c:<4} rps={r['rps']:>8.1f} p50={r['p50_ms']:>7.2f}ms "
                      f"p99={r['p99_ms']:>7.2f}ms cpu/req={r['cpu_ms_per_req']:.3f}ms errors={r['errors']}",
                      flush=True)
        return results
    finally:
        stop_all([*routers.values(), *prefill, *decode], timeout=10)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="pdserve bench router", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--requests", type=int, default=3000, help="measured requests per point")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128],
                    help="client concurrency levels, one run each")
    ap.add_argument("--policy", default="round_robin", choices=["random", "round_robin", "cache_aware",
                                                                 "power_of_two"],
                    help="router policy under test")
    ap.add_argument("--prefill-workers", type=int, default=2,
                    help="recording prefill stand-ins behind the router")
    ap.add_argument("--decode-workers", type=int, default=2,
                    help="recording decode stand-ins behind the router")
    ap.add_argument("--log-dir", default="/tmp/pdserve_bench_router",
                    help="logs of the router and the stand-ins")
    args = ap.parse_args(argv)
    try:
        import uvloop

        results = uvloop.run(run(args))
    except ImportError:
        results = asyncio.run(run(args))
    ratios = {}
    print(f"\n{'point':<8}{'ours rps':>10}{'ref rps':>10}{'ours cpu ms':>13}{'ref cpu ms':>12}"
          f"{'ours p50':>10}{'ref p50':>10}{'ours p99':>10}{'ref p99':>10}")
    for c in args.concurrency:
        o, r = results["ours"][f"c{c}"], results["sglang_router"][f"c{c}"]
        ratios[f"rps_c{c}"] = o["rps"] / r["rps"]
        ratios[f"cpu_c{c}"] = r["cpu_ms_per_req"] / o["cpu_ms_per_req"]
        print(f"c{c:<7}{o['rps']:>10.1f}{r['rps']:>10.1f}{o['cpu_ms_per_req']:>13.3f}{r['cpu_ms_per_req']:>12.3f}"
              f"{o['p50_ms']:>10.2f}{r['p50_ms']:>10.2f}{o['p99_ms']:>10.2f}{r['p99_ms']:>10.2f}")
    figures = {"ours": results["ours"], "sglang_router": results["sglang_router"],
               "settings": {"requests": args.requests, "concurrency": args.concurrency, "policy": args.policy,
                            "prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers,
                            "endpoint": "/generate (non-streaming)"},
               "mini_lb_cpu_ms_per_req_quoted": MINI_LB_CPU_MS}
    write_report(args.json, "router", figures, ratios)
    return {"figures": figures, "ratios": ratios}


if __name__ == "__main__":
    main()
