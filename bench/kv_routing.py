"""`pdserve bench kv_routing`: exact cache-aware routing from KV events (`router --kv-events`) against
sglang-router's approximate `cache_aware` tree, on the same prefill nodes in one run.

Starts N prefill nodes (each with `--kv-events-config`), one decode node (fake transfer: the bench is
about where prefills land) and two routers in front of them: one `--policy cache_aware` (the character
tree), one `--policy cache_aware --kv-events`. Each workload runs once through each router, the nodes'
caches flushed before each run:

* `rag`: G groups share a system prompt of `--prefix-tokens`; each request adds its own long user text
  (`--suffix-tokens`, a document to work on), so the shared part is a minority of each prompt;
* `chat`: the same groups with short user turns (`--chat-suffix-tokens`): the shared part dominates.

Each workload has its own system prompts. Requests of all groups are interleaved and sent
`--concurrency` at a time, streamed, `--output-len` tokens each; each mode runs twice per workload in
the order tree, exact, exact, tree, so a drift of a shared machine's speed weighs on both alike. Per
run: the prefix-hit rate (the prefill nodes' cached prompt tokens / prompt tokens, from their /metrics),
TTFT p50/p99 and the spread of requests over the nodes. Ratios (higher is better): `hit_rate_<w>`
exact / tree, `ttft_p50_<w>` and `ttft_p99_<w>` tree / exact.

The nodes and routers are deploy's processes (`RoleNode`, `RouterProcess`: deploy/nodes.py), each with
its log `<log-dir>/<name>.log` (`prefill-0`, `decode`, `router-tree`, `router-exact`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
import urllib.request

from bench.report import write_report
from deploy.nodes import RoleNode, RouterProcess
from deploy.process import start_together, stop_all
from deploy.procs import free_port

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud maple orbit "
         "signal harbor lantern meadow copper violet summit canyon").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def _post(url: str, body: dict | None = None) -> int:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def nodes(ns: argparse.Namespace, model: str, log_dir: str) -> tuple[list[RoleNode], RoleNode]:
    """The prefill nodes, each publishing its KV events on endpoints of its own, and the decode node
    (not started); fake transfer, one torch thread each, passive OpenMP threads."""
    settings = {"page_size": ns.page_size, "max_total_tokens": ns.max_total_tokens, "num_threads": 1,
                "chunked_prefill_size": 1024, "transfer_backend": "fake", "log_level": None}

    def node(role: str, name: str, **more) -> RoleNode:
        return RoleNode(role, model, name=name, env={"OMP_WAIT_POLICY": "PASSIVE"}, echo_command=True,
                        log_path=os.path.join(log_dir, f"{name}.log"), **settings, **more)

    def events() -> str:
        return json.dumps({"endpoint": f"tcp://127.0.0.1:{free_port()}",
                           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})

    prefills = [node("prefill", f"prefill-{i}", disaggregation_bootstrap_port=free_port(),
                     kv_events_config=events()) for i in range(ns.prefill)]
    return prefills, node("decode", "decode")


def workload(ns: argparse.Namespace, suffix_tokens: int, seed: int) -> list[str]:
    """Texts of `groups` x `per_group` requests, the groups interleaved in a random order. One word of
    the filler is about one token of SmolLM2's tokenizer."""
    rng = random.Random(seed)
    prefixes = [f"System prompt {g}: " + _words(rng, ns.prefix_tokens) for g in range(ns.groups)]
    reqs = [(g, prefixes[g] + f"\nUser {i}: " + _words(rng, suffix_tokens)) for g in range(ns.groups)
            for i in range(ns.per_group)]
    rng.shuffle(reqs)
    return [t for _, t in reqs]


async def _one(session, url: str, text: str, out_len: int) -> float:
    body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": out_len, "temperature": 0,
                                                              "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/generate answered {r.status}: {(await r.read())[:300]!r}")
        async for chunk in r.content.iter_any():
            if ttft is None and b"data:" in chunk:
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else time.perf_counter() - t0


async def _drive(url: str, texts: list[str], ns: argparse.Namespace) -> list[float]:
    import aiohttp

    sem = asyncio.Semaphore(ns.concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def go(t):
            async with sem:
                return await _one(session, url, t, ns.output_len)

        return list(await asyncio.gather(*(go(t) for t in texts)))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_once(router: str, prefills: list[str], texts: list[str], ns: argparse.Namespace) -> dict:
    for p in prefills:
        _post(p + "/flush_cache")
    time.sleep(1.0)  # the flushes' events reach the exact router
    before = [(_metric(p, "sglang:cached_tokens_total"), _metric(p, "sglang:prompt_tokens_total"),
               _metric(p, "pdserve_requests_total")) for p in prefills]
    t0 = time.perf_counter()
    ttfts = asyncio.run(_drive(router, texts, ns))
    wall = time.perf_counter() - t0
    after = [(_metric(p, "sglang:cached_tokens_total"), _metric(p, "sglang:prompt_tokens_total"),
              _metric(p, "pdserve_requests_total")) for p in prefills]
    cached = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    prompt = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {"wall_s": wall, "prompt_tokens": prompt, "cached_tokens": cached, "ttfts": ttfts,
            "requests_per_node": [int(a[2] - b[2]) for a, b in zip(after, before, strict=True)]}


def summary(runs: list[dict]) -> dict:
    """One mode's runs of one workload together."""
    ttfts = [t for r in runs for t in r["ttfts"]]
    prompt, cached = sum(r["prompt_tokens"] for r in runs), sum(r["cached_tokens"] for r in runs)
    return {"requests": len(ttfts), "runs": len(runs), "wall_s": round(sum(r["wall_s"] for r in runs), 3),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "hit_rate_per_run": [round(r["cached_tokens"] / r["prompt_tokens"], 4)
                                 if r["prompt_tokens"] else 0.0
                                 for r in runs],
            "ttft_p50_ms": round(_pct(ttfts, 0.5) * 1e3, 2), "ttft_p99_ms": round(_pct(ttfts, 0.99) * 1e3, 2),
            "ttft_mean_ms": round(sum(ttfts) / len(ttfts) * 1e3, 2),
            "requests_per_node": [r["requests_per_node"] for r in runs]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench kv_routing", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny",
      help="'tiny' (random weights, SmolLM2's tokenizer; default), 'default' or a directory")
    a("--prefill", type=int, default=3, help="prefill nodes (default 3)")
    a("--groups", type=int, default=8, help="distinct system prompts (default 8)")
    a("--per-group", type=int, default=12, help="requests per group and workload (default 12)")
    a("--prefix-tokens", type=int, default=256, help="words of each system prompt (~tokens; default 256)")
    a("--suffix-tokens", type=int, default=768, help="words of each rag request's own text (default 768)")
    a("--chat-suffix-tokens", type=int, default=48, help="words of each chat request's own text (default 48)")
    a("--output-len", type=int, default=4, help="output tokens per request")
    a("--concurrency", type=int, default=4, help="requests in flight")
    a("--max-total-tokens", type=int, default=8192,
      help="each prefill node's KV cache in tokens (default 8192)")
    a("--page-size", type=int, default=16, help="KV page size of the nodes (the events' block size)")
    a("--repeats", type=int, choices=(1, 2), default=2,
      help="runs of each mode per workload: 2 (default) runs tree, exact, exact, tree; 1 runs tree, exact")
    a("--seed", type=int, default=0, help="seed of the prompts")
    a("--log-dir", default=None, help="children's logs (default: a new temporary folder)")
    a("--json", default=None, help="write the report here")
    return p


def _model(name: str) -> str:
    if name == "tiny":
        from common.models.tiny_model import tiny_model_dir

        return tiny_model_dir()
    if name == "default":
        from common.models.default_model import resolve_model_path

        return resolve_model_path("default")
    return name


def main(argv: list[str] | None = None) -> dict | int:
    ns = build_parser().parse_args(argv)
    model = _model(ns.model)
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="pdserve-kv-routing-")
    os.makedirs(log_dir, exist_ok=True)
    prefills, decode = nodes(ns, model, log_dir)
    routers = {mode: RouterProcess(prefills, [decode], "--policy", "cache_aware",
                                   "--worker-startup-check-interval", "0.2", *extra, name=f"router-{mode}",
                                   log_path=os.path.join(log_dir, f"router-{mode}.log"), echo_command=True)
               for mode, extra in (("tree", []), ("exact", ["--kv-events"]))}
    servers = [*routers.values(), *prefills, decode]
    try:
        start_together([*prefills, decode])
        start_together(list(routers.values()))
        time.sleep(1.0)  # the exact router's first replays
        # warm-up (not measured): every node compiles and allocates once
        asyncio.run(_drive(routers["tree"].url, workload(ns, 32, ns.seed + 99)[:2 * ns.prefill], ns))
        figures: dict = {"config": {k: v for k, v in vars(ns).items() if k not in ("json", "log_dir")},
                         "command": "pdserve bench kv_routing "
                         + " ".join(shlex.quote(a) for a in (argv or []))}
        ratios = {}
        for k, (wname, suffix) in enumerate((("rag", ns.suffix_tokens), ("chat", ns.chat_suffix_tokens))):
            # new system prompts: the tree's older entries do not match
            texts = workload(ns, suffix, ns.seed + k)
            runs: dict[str, list[dict]] = {"tree": [], "exact": []}
            # ABBA: drift of a shared machine cancels
            for mode in ("tree", "exact", "exact", "tree")[:2 * ns.repeats]:
                runs[mode].append(run_once(routers[mode].url, [p.url for p in prefills], texts, ns))
            res = {mode: summary(r) for mode, r in runs.items()}
            for mode in ("tree", "exact"):
                print(f"{wname:5s} {mode:5s} hit rate {res[mode]['hit_rate']:.3f}  TTFT p50 "
                      f"{res[mode]['ttft_p50_ms']:.1f} ms p99 {res[mode]['ttft_p99_ms']:.1f} ms  per node "
                      f"{res[mode]['requests_per_node']}", flush=True)
            figures[wname] = res
            t, e = res["tree"], res["exact"]
            ratios[f"hit_rate_{wname}"] = e["hit_rate"] / t["hit_rate"] if t["hit_rate"] \
                else float(e["hit_rate"] > 0)
            ratios[f"ttft_p50_{wname}"] = t["ttft_p50_ms"] / e["ttft_p50_ms"]
            ratios[f"ttft_p99_{wname}"] = t["ttft_p99_ms"] / e["ttft_p99_ms"]
        with urllib.request.urlopen(routers["exact"].url + "/get_server_info", timeout=10) as r:
            figures["exact_router"] = json.loads(r.read())["router"].get("kv_events")
    finally:
        stop_all(servers, timeout=20)
    return write_report(ns.json, "kv_routing", figures, ratios)


if __name__ == "__main__":
    sys.exit(0 if isinstance(main(), dict) else 1)
