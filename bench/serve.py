"""`pdserve bench serve`: an online serving benchmark against any OpenAI-compatible base URL (a node,
the router, or another server), in the manner of SGLang's `bench_serving`.

Datasets (nothing is downloaded):
  random   prompts of random vocabulary tokens with input/output lengths drawn uniformly from
           [len * range_ratio, len]; exact token counts when a tokenizer is available (`--tokenizer`, or
           the server's own from `/model_info` when it runs on this machine), random words otherwise;
  chat     synthetic multi-turn chats (system prompt, earlier turns, a final question) of the same
           length distribution, sent to /v1/chat/completions.
Arrivals: Poisson (default) or fixed spacing at `--request-rate` req/s (inf: all at once), capped by
`--max-concurrency`; `--warmup-requests` run first and are not counted (copies of the first requests whose
prompts start with another word, so no measured prompt is in the server's prefix cache when it is sent).

Every request streams (`stream_options.include_usage`), so TTFT is the first content chunk, ITL the
gaps between content chunks, TPOT (latency - TTFT) / (output tokens - 1). The report has request and
token throughput, TTFT/TPOT/ITL/E2E latency (mean, p50, p90, p99, ms), and goodput: completed requests
per second that met every SLO given (`--slo-ttft-ms`, `--slo-tpot-ms`).

`--json FILE` writes the report through `bench.report.write_report`. One `bench serve` run compares
nothing, so its `"ratios"` object is empty (`{}`); `pdserve bench compare` fills ratios. `--plot FILE`
(default: the JSON path with `.png`) draws the latency CDFs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import string
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import aiohttp

from bench.report import HelpFormatter, write_report

LATENCY_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class BenchRequest:
    prompt: str | list[dict]  # text for /v1/completions, messages for /v1/chat/completions
    prompt_len: int  # tokens by our tokenizer (or words when there is none); the server's count wins
    output_len: int
    api: str = "completions"  # "completions" | "chat"
    tag: str = "default"  # requests are also summarized per tag (bench compare: "decode", "long")
    send_at: float | None = None  # seconds after the start; None: the arrival process decides


WARMUP_PREFIX = "Warm-up. "


def warmup_copy(req: BenchRequest) -> BenchRequest:
    """`req` with its prompt behind a different first word: the same shape of work, but a prompt no measured
    request starts with, so that a server's prefix cache holds none of the measured prompts afterwards (a
    warm-up that sent a measured prompt made that request's TTFT a cache hit)."""
    if isinstance(req.prompt, str):
        prompt: str | list[dict] = WARMUP_PREFIX + req.prompt
    else:
        prompt = [dict(m) for m in req.prompt]
        prompt[0]["content"] = WARMUP_PREFIX + prompt[0]["content"]
    return replace(req, prompt=prompt, send_at=None)


@dataclass
class RequestResult:
    ok: bool
    tag: str
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    start: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    resent: bool = False  # the first try's connection closed before any response (see send_one)

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


# ---------------------------------------------------------------------------------------------- datasets
class PromptMaker:
    """Random text of a given token length, from the model's tokenizer or from random words."""

    def __init__(self, tokenizer_path: str | None, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tok = None
        self.words: list[str] = []
        if tokenizer_path:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
            special = set(self.tok.all_special_ids)
            # word-like vocabulary entries: decode alone to " letters", re-encode to one token
            for tid in range(min(self.tok.vocab_size, 50000)):
                if tid in special:
                    continue
                piece = self.tok.decode([tid])
                if len(piece) > 2 and piece[0] == " " and piece[1:].isalpha() and piece[1:].isascii():
                    self.words.append(piece)
            if len(self.words) < 100:
                raise RuntimeError(f"tokenizer {tokenizer_path}: too few word-like tokens to build prompts")
        else:
            letters = string.ascii_lowercase
            for _ in range(4000):
                n = self.rng.randint(3, 8)
                self.words.append(" " + "".join(self.rng.choice(letters) for _ in range(n)))

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text.split())
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, n: int) -> str:
        """Text of exactly `n` tokens by our tokenizer (n words without one)."""
        n = max(1, n)
        text = "".join(self.rng.choice(self.words) for _ in range(n)).lstrip()
        if self.tok is None:
            return text
        for _ in range(8):  # merges at word joins can shift the count: trim or pad and re-check
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) == n:
                return text
            if len(ids) > n:
                text = self.tok.decode(ids[:n])
            else:
                text = text + "".join(self.rng.choice(self.words) for _ in range(n - len(ids)))
        return text


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    lo = max(1, int(length * range_ratio))
    return [rng.randint(lo, max(lo, length)) for _ in range(n)]


def random_dataset(maker: PromptMaker, num: int, input_len: int, output_len: int, range_ratio: float,
                   api: str = "completions", tag: str = "default") -> list[BenchRequest]:
    ins = sample_lengths(maker.rng, num, input_len, range_ratio)
    outs = sample_lengths(maker.rng, num, output_len, range_ratio)
    reqs = []
    for i, o in zip(ins, outs, strict=True):
        text = maker.text(i)
        prompt: str | list[dict] = text if api == "completions" else [{"role": "user", "content": text}]
        reqs.append(BenchRequest(prompt, maker.count(text), o, api, tag))
    return reqs


def chat_dataset(maker: PromptMaker, num: int, input_len: int, output_len: int, range_ratio: float,
                 max_turns: int = 4) -> list[BenchRequest]:
    """Synthetic chats: a system prompt, 0..max_turns-1 earlier user/assistant turns, a final question;
    the message texts add up to the drawn input length (the chat template adds a few tokens more)."""
    rng = maker.rng
    ins = sample_lengths(rng, num, input_len, range_ratio)
    outs = sample_lengths(rng, num, output_len, range_ratio)
    reqs = []
    for total, o in zip(ins, outs, strict=True):
        turns = rng.randint(0, max_turns - 1)
        n_msgs = 2 + 2 * turns
        if total < n_msgs:
            n_msgs, turns = 2, 0
        cuts = sorted(rng.sample(range(1, total), n_msgs - 1)) if total > n_msgs else list(range(1, n_msgs))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        roles = ["system"] + ["user", "assistant"] * turns + ["user"]
        msgs = [{"role": r, "content": maker.text(s)} for r, s in zip(roles, sizes, strict=True)]
        reqs.append(BenchRequest(msgs, sum(maker.count(m["content"]) for m in msgs), o, "chat", "chat"))
    return reqs


# ---------------------------------------------------------------------------------------------- client
async def fetch_model_info(base_url: str) -> tuple[str, str | None]:
    """(served model name, local tokenizer path or None) of the server at base_url."""
    root = base_url.rstrip("/").removesuffix("/v1")
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(root + "/v1/models") as r:
            r.raise_for_status()
            name = (await r.json())["data"][0]["id"]
        tokenizer = None
        try:
            async with s.get(root + "/model_info") as r:
                if r.status == 200:
                    tokenizer = (await r.json()).get("tokenizer_path")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            tokenizer = None
    return name, tokenizer


async def send_one(session: aiohttp.ClientSession, base_url: str, model: str, req: BenchRequest,
                   extra_body: dict) -> RequestResult:
    root = base_url.rstrip("/").removesuffix("/v1")
    body: dict = {"model": model, "max_tokens": req.output_len, "stream": True, "temperature": 0.0,
                  "ignore_eos": True, "stream_options": {"include_usage": True}, **extra_body}
    if req.api == "chat":
        url = root + "/v1/chat/completions"
        body["messages"] = req.prompt
    else:
        url = root + "/v1/completions"
        body["prompt"] = req.prompt
    res = RequestResult(ok=False, tag=req.tag, prompt_len=req.prompt_len)
    start = time.perf_counter()
    res.start = start
    last = start
    chunks = 0
    usage = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                resp = await session.post(url, json=body)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # a kept-alive connection the server had closed (llama.cpp's server ends them so; the
                # body's write or the wait for an answer fails): no response came, so the request is sent
                # once more on a connection of its own, not on another kept-alive one it may have closed too
                res.resent = True
                fresh = await stack.enter_async_context(aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(force_close=True), timeout=session.timeout))
                resp = await fresh.post(url, json=body)
            async with resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return res
                buf = b""
                async for data in resp.content.iter_any():
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        event = json.loads(payload)
                        if "error" in event:
                            res.error = str(event["error"])[:300]
                            return res
                        if event.get("usage"):
                            usage = event["usage"]
                        for choice in event.get("choices") or []:
                            piece = choice.get("text") if req.api != "chat" else \
                                (choice.get("delta") or {}).get("content")
                            if piece:
                                now = time.perf_counter()
                                if chunks == 0:
                                    res.ttft = now - start
                                else:
                                    res.itl.append(now - last)
                                last = now
                                chunks += 1
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if usage:
        res.output_len = int(usage.get("completion_tokens") or chunks)
        res.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
    else:
        res.output_len = chunks
    if chunks == 0:
        res.error = "no content chunk in the stream"
        return res
    res.ok = True
    return res


def arrival_offsets(n: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return out


async def run_benchmark(base_url: str, requests: list[BenchRequest], *, model: str,
                        request_rate: float = math.inf,
                        arrival: str = "poisson", max_concurrency: int | None = None, warmup: int = 1,
                        seed: int = 0, extra_body: dict | None = None, progress: bool = True,
                        timeout: float = 3600.0) -> tuple[list[RequestResult], float]:
    """Send `requests` (`warmup` ones first, uncounted: copies of the first requests behind another first
    word, `warmup_copy`); returns (results in request order, duration s)."""
    extra_body = extra_body or {}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        if warmup > 0 and requests:
            warm = [warmup_copy(requests[i % len(requests)]) for i in range(warmup)]
            warm_res = await asyncio.gather(*(send_one(session, base_url, model, r, extra_body)
                                              for r in warm))
            bad = [r.error for r in warm_res if not r.ok]
            if len(bad) == len(warm_res):
                raise RuntimeError(f"every warmup request failed, e.g. {bad[0]}")
        rng = random.Random(seed)
        offsets = arrival_offsets(len(requests), request_rate, arrival, rng)
        offsets = [r.send_at if r.send_at is not None else o for r, o in zip(requests, offsets, strict=True)]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="requests", file=sys.stderr)
        t0 = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                r = await send_one(session, base_url, model, req, extra_body)
            else:
                async with sem:
                    r = await send_one(session, base_url, model, req, extra_body)
            if bar is not None:
                bar.update(1)
            return r

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return list(results), duration


# ---------------------------------------------------------------------------------------------- metrics
def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    xs = sorted(values)

    def pct(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": round(sum(xs) / len(xs) * scale, 3), "p50": round(pct(50) * scale, 3),
            "p90": round(pct(90) * scale, 3), "p99": round(pct(99) * scale, 3), "n": len(xs)}


def latency_values(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
            "itl": [x for r in ok for x in r.itl], "e2e": [r.latency for r in ok]}


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 4),
        "input_throughput": round(input_tokens / duration, 2),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 2),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "resent": sum(r.resent for r in results),
    }
    for key, vals in latency_values(results).items():
        out[f"{key}_ms"] = percentiles(vals)
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = 0
        for r in ok:
            if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
                continue
            if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > slo_tpot_ms:
                continue
            good += 1
        out["goodput"] = round(good / duration, 4)
        out["good_requests"] = good
        out["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}
    else:
        out["goodput"] = None
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_errors"] = errors[:5]
    return out


def format_summary(title: str, s: dict) -> str:
    lines = [f"{'=' * 20} {title} {'=' * 20}",
             f"{'successful requests':<32}{s['completed']}", f"{'failed requests':<32}{s['failed']}",
             *([f"{'sent twice (connection closed)':<32}{s['resent']}"] if s.get("resent") else []),
             f"{'duration (s)':<32}{s['duration_s']:.2f}",
             f"{'request throughput (req/s)':<32}{s['request_throughput']:.3f}",
             f"{'input throughput (tok/s)':<32}{s['input_throughput']:.1f}",
             f"{'output throughput (tok/s)':<32}{s['output_throughput']:.1f}"]
    if s.get("goodput") is not None:
        lines.append(f"{'goodput (req/s)':<32}{s['goodput']:.3f}  ({s['good_requests']} within SLO "
                     f"{s['slo']})")
    for key in LATENCY_KEYS:
        p = s[f"{key}_ms"]
        if p["n"]:
            lines.append(f"{key.upper() + ' (ms)':<32}mean {p['mean']:.1f}  p50 {p['p50']:.1f}  "
                         f"p90 {p['p90']:.1f}  p99 {p['p99']:.1f}")
    for err in s.get("first_errors", []):
        lines.append(f"  error: {err}")
    return "\n".join(lines)


def plot_cdfs(runs: dict[str, list[RequestResult]], path: str, title: str = "latency CDFs") -> str:
    """One panel per latency kind (TTFT, TPOT, ITL, E2E), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key in zip(axes.flat, LATENCY_KEYS, strict=True):
        for name, results in runs.items():
            xs = sorted(v * 1000 for v in latency_values(results)[key])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=name)
        ax.set_title(key.upper())
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def result_rows(results: list[RequestResult]) -> list[dict]:
    rows = []
    for r in results:
        d = asdict(r)
        d.pop("itl")
        d["tpot"] = r.tpot
        rows.append(d)
    return rows


# ---------------------------------------------------------------------------------------------- CLI
def setup_bench_parser(bench: str, doc: str, size_help: str, setups: str, setups_help: str,
                       **defaults) -> argparse.ArgumentParser:
    """The parser of `pdserve bench <bench>` (dp, pp): the setup flags (`add_setup_flags`, with `defaults`),
    `--<bench>-size` (default 2) and `--setups`."""
    from bench.report import HelpFormatter

    p = argparse.ArgumentParser(prog=f"pdserve bench {bench}", description=doc.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_setup_flags(p, bench, **defaults)
    p.add_argument(f"--{bench}-size", type=int, default=2, help=size_help)
    p.add_argument("--setups", default=setups, help=setups_help)
    return p


def add_setup_flags(p: argparse.ArgumentParser, bench: str, *, num_prompts: int,
                    input_len: int, output_len: int, concurrency: int) -> None:
    """The flags of a bench that runs `pdserve serve` setups one after the other on one workload of random
    completions (`setup_workload`, `bench.compare.run_colocated_setups`), with this bench's defaults."""
    a = p.add_argument
    a("--model", default="default", help="model of every setup ('default' or a directory)")
    a("--num-prompts", type=int, default=num_prompts, help="requests per setup")
    a("--random-input-len", type=int, default=input_len, help="longest prompt (tokens)")
    a("--random-output-len", type=int, default=output_len, help="output tokens of every request")
    a("--random-range-ratio", type=float, default=0.5, help="prompt lengths drawn from [len * ratio, len]")
    a("--max-concurrency", type=int, default=concurrency, help="most requests in flight")
    a("--warmup-requests", type=int, default=2, help="requests sent and discarded before each measured run")
    a("--node-args", default="", help="flags for every node, one string")
    a("--seed", type=int, default=1, help="seed of prompts")
    a("--startup-timeout", type=float, default=900.0, help="seconds for a node to become healthy")
    a("--log-dir", default=None, help=f"the nodes' logs (default ./logs/{bench}-<timestamp>)")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--json", default=None, help="write the report here")


def setup_workload(ns: argparse.Namespace, bench: str) -> tuple[list[int], str, list[BenchRequest]]:
    """What a bench that runs server setups one after the other starts with: the cores this process may
    run on, its log folder (`--log-dir`, else ./logs/<bench>-<timestamp>) and `--num-prompts` random
    completions of ns' lengths."""
    import os

    from common.models.default_model import resolve_model_path

    model_dir = resolve_model_path(ns.model)
    cores = sorted(os.sched_getaffinity(0))
    log_dir = ns.log_dir or os.path.join(os.getcwd(), "logs", time.strftime(f"{bench}-%Y%m%d-%H%M%S"))
    os.makedirs(log_dir, exist_ok=True)
    requests = random_dataset(PromptMaker(model_dir, ns.seed), ns.num_prompts, ns.random_input_len,
                              ns.random_output_len, ns.random_range_ratio, "completions")
    return cores, log_dir, requests


def measure_setup(name: str, url: str, requests: list[BenchRequest], ns: argparse.Namespace) -> dict:
    """One setup's run of `requests` at `url` (ns: max_concurrency, warmup_requests, seed, disable_tqdm):
    its summary and per-request rows."""
    model = asyncio.run(fetch_model_info(url))[0]
    print(f"[{name}] {len(requests)} requests against {url}", file=sys.stderr, flush=True)
    results, duration = asyncio.run(run_benchmark(url, requests, model=model,
                                                  max_concurrency=ns.max_concurrency,
                                                  warmup=ns.warmup_requests, seed=ns.seed,
                                                  progress=not ns.disable_tqdm))
    return {"summary": summarize(results, duration), "requests": result_rows(results)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:30000", help="server root (the router or a node)")
    a("--model", default=None, help="model name in requests (default: the server's first /v1/models entry)")
    a("--tokenizer", default=None, help="tokenizer directory for exact prompt lengths (default: the "
      "server's, when it is on this machine); 'none' uses random words")
    a("--dataset", choices=["random", "chat"], default="random",
      help="random prompts, or multi-turn chats that grow turn by turn")
    a("--api", choices=["completions", "chat"], default=None,
      help="endpoint for the random dataset (default completions; the chat dataset always uses chat)")
    a("--num-prompts", type=int, default=100, help="requests to send")
    a("--random-input-len", type=int, default=256, help="prompt tokens of the random dataset")
    a("--random-output-len", type=int, default=64, help="output tokens per request")
    a("--random-range-ratio", type=float, default=0.0,
      help="lengths are drawn uniformly from [len * ratio, len] (1.0: fixed)")
    a("--chat-max-turns", type=int, default=4, help="turns per conversation of the chat dataset")
    a("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    a("--arrival", choices=["poisson", "fixed"], default="poisson",
      help="inter-arrival times at --request-rate: exponential (poisson) or equal (fixed)")
    a("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    a("--warmup-requests", type=int, default=1, help="requests sent and discarded before the measured run")
    a("--slo-ttft-ms", type=float, default=None,
      help="goodput counts only requests whose TTFT is within this (default: no TTFT SLO)")
    a("--slo-tpot-ms", type=float, default=None,
      help="goodput counts only requests whose TPOT is within this (default: no TPOT SLO)")
    a("--seed", type=int, default=1, help="seed of prompts and arrivals")
    a("--extra-body", default=None, help="JSON object merged into every request body")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--json", default=None, help="write the report here")
    a("--plot", default=None, help="PNG of the latency CDFs (default: the --json path with .png)")
    return p


def build_requests(ns: argparse.Namespace, maker: PromptMaker) -> list[BenchRequest]:
    if ns.dataset == "chat":
        return chat_dataset(maker, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                            ns.random_range_ratio, ns.chat_max_turns)
    return random_dataset(maker, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                          ns.random_range_ratio, ns.api or "completions")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.num_prompts < 1:
        print("--num-prompts must be >= 1", file=sys.stderr)
        return 2
    extra = json.loads(ns.extra_body) if ns.extra_body else {}
    try:
        name, server_tok = asyncio.run(fetch_model_info(ns.base_url))
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        print(f"cannot reach {ns.base_url}: {e}", file=sys.stderr)
        return 1
    model = ns.model or name
    tok_path = None if ns.tokenizer == "none" else (ns.tokenizer or server_tok)
    if tok_path and ns.tokenizer is None:
        import os

        if not os.path.isdir(tok_path):
            tok_path = None  # the server's tokenizer is on another machine
    maker = PromptMaker(tok_path, ns.seed)
    requests = build_requests(ns, maker)
    print(f"bench serve: {len(requests)} {ns.dataset} requests to {ns.base_url} (model {model}, "
          f"rate {ns.request_rate} {ns.arrival}, max concurrency {ns.max_concurrency}, "
          f"prompt lengths by {'tokenizer ' + tok_path if tok_path else 'random words'})", file=sys.stderr)
    results, duration = asyncio.run(run_benchmark(
        ns.base_url, requests, model=model, request_rate=ns.request_rate, arrival=ns.arrival,
        max_concurrency=ns.max_concurrency, warmup=ns.warmup_requests, seed=ns.seed, extra_body=extra,
        progress=not ns.disable_tqdm))
    summary = summarize(results, duration, ns.slo_ttft_ms, ns.slo_tpot_ms)
    print(format_summary("serving benchmark", summary))
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(ns).items()}
    config.update(model=model, tokenizer=tok_path, argv=list(argv) if argv is not None else sys.argv[1:])
    figures = {"config": config, "summary": summary, "requests": result_rows(results)}
    write_report(ns.json, "serve", figures, {})
    plot = ns.plot or (ns.json.rsplit(".", 1)[0] + ".png" if ns.json else None)
    if plot:  # after the JSON: a missing plotting library never loses the figures
        try:
            plot_cdfs({"run": results}, plot, f"pdserve bench serve: {ns.dataset}, {len(requests)} requests")
            print(f"wrote {plot}")
        except ImportError as e:
            print(f"no plot ({e}; pip install 'pdserve[bench]' for matplotlib)", file=sys.stderr)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
