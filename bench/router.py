"""`pdserve bench router`: this router against sglang-router (Rust, from PyPI) in PD mode, same recording
workers, same load, one run. Reports requests/s, p50/p99 latency and the router's CPU seconds per request
(user+sys of the router process, threads included) at each concurrency, and the ratios."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from bench.report import write_report

REPO = Path(__file__).resolve().parents[1]
WORKER_SCRIPT = REPO / "tests" / "router" / "workers.py"
MINI_LB_CPU_MS = 2.9  # SGLang's Python mini load balancer, CPU ms per request (figure quoted in the issue)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {url} exited with {proc.returncode}")
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {timeout}s")
            await asyncio.sleep(0.1)


def start_workers(n_prefill: int, n_decode: int):
    procs, prefill, decode = [], [], []
    for i in range(n_prefill + n_decode):
        role = "prefill" if i < n_prefill else "decode"
        port = free_port()
        cmd = [sys.executable, str(WORKER_SCRIPT), "--port", str(port), "--role", role, "--no-record"]
        if role == "prefill":
            cmd += ["--bootstrap-port", str(8998 + i)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        (prefill if role == "prefill" else decode).append((f"http://127.0.0.1:{port}", 8998 + i))
    return procs, prefill, decode


def pd_args(prefill, decode, policy: str) -> list[str]:
    args = ["--pd-disaggregation", "--policy", policy]
    for url, bport in prefill:
        args += ["--prefill", url, str(bport)]
    for url, _ in decode:
        args += ["--decode", url]
    return args


def start_router(kind: str, prefill, decode, policy: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port, prom = free_port(), free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(prom)] + pd_args(prefill, decode, policy)
    if kind == "ours":
        cmd = [sys.executable, "-m", "router"] + common
    else:
        cmd = [sys.executable, "-m", "sglang_router.launch_router"] + common
    log = open(log_dir / f"{kind}.log", "w")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


async def wait_router(url: str, proc: subprocess.Popen) -> None:
    await wait_http(url + "/health", proc=proc)
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as s:
        while True:  # ready when a request goes through end to end
            try:
                async with s.post(url + "/generate", json={"text": "warm up"}) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"router {url} never served a request")
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
            "p50_ms": round(statistics.median(lat) * 1e3, 2), "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 2),
            "cpu_ms_per_req": round(cpu / n * 1e3, 4)}


async def run(args) -> dict:
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, prefill, decode = start_workers(args.prefill_workers, args.decode_workers)
    routers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for url, _ in prefill + decode:
            await wait_http(url + "/health")
        for kind in ("ours", "sglang_router"):
            routers[kind] = start_router(kind, prefill, decode, args.policy, log_dir)
        for proc, url in routers.values():
            await wait_router(url, proc)
        results: dict[str, dict] = {"ours": {}, "sglang_router": {}}
        for c in args.concurrency:
            for kind in ("sglang_router", "ours"):
                proc, url = routers[kind]
                r = await measure(url, proc.pid, args.requests, c)
                results[kind][f"c{c}"] = r
                print(f"{kind:>14} c={c:<4} rps={r['rps']:>8.1f} p50={r['p50_ms']:>7.2f}ms "
                      f"p99={r['p99_ms']:>7.2f}ms cpu/req={r['cpu_ms_per_req']:.3f}ms errors={r['errors']}",
                      flush=True)
        return results
    finally:
        for proc, _ in routers.values():
            proc.terminate()
        for proc in procs:
            proc.terminate()
        for proc in [p for p, _ in routers.values()] + procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


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
    ap.add_argument("--prefill-workers", type=int, default=2, help="recording prefill stand-ins behind the router")
    ap.add_argument("--decode-workers", type=int, default=2, help="recording decode stand-ins behind the router")
    ap.add_argument("--log-dir", default="/tmp/pdserve_bench_router", help="logs of the router and the stand-ins")
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
