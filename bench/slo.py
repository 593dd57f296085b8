"""SLO attainment over a sweep of request rates, the way DistServe compares serving systems (used by
`pdserve bench compare`).

At each rate the same kind of requests arrive as a Poisson process; a request attains the SLOs when
its TTFT and its TPOT are both within them (a failed request never does). The figure of merit is the
highest rate at which at least `target` (90 %) of the requests attain them: between the last rate
that does and the first that does not, the crossing is interpolated linearly; when every rate does,
it is the highest rate swept (a lower bound); when none does, 0.

The SLOs are fixed before any run, in `compare.py`'s defaults, for interactive chat on a CPU serving
a small model: the first token within 2 s, then at least 10 tokens per second (TPOT <= 100 ms, about
twice reading speed).
"""

from __future__ import annotations

import asyncio
import sys

from bench.serve import BenchRequest, RequestResult, run_benchmark, summarize

TARGET = 0.9


def attains(r: RequestResult, ttft_ms: float, tpot_ms: float) -> bool:
    if not r.ok or r.ttft * 1000 > ttft_ms:
        return False
    return r.tpot is None or r.tpot * 1000 <= tpot_ms


def attainment(results: list[RequestResult], ttft_ms: float, tpot_ms: float) -> float:
    return sum(attains(r, ttft_ms, tpot_ms) for r in results) / len(results) if results else 0.0


def max_rate(points: list[tuple[float, float]], target: float = TARGET) -> float:
    """The highest rate at which attainment >= target, from (rate, attainment) points."""
    points = sorted(points)
    best = 0.0
    for i, (rate, att) in enumerate(points):
        if att >= target:
            best = rate
            continue
        if i > 0 and points[i - 1][1] >= target:  # interpolate the crossing
            r0, a0 = points[i - 1]
            best = r0 + (rate - r0) * (a0 - target) / (a0 - att)
        break
    return best


def sweep(url: str, model: str, make_requests, rates: list[float], ttft_ms: float, tpot_ms: float, seed: int,
          name: str) -> list[dict]:
    """Run `make_requests(rate)` at each rate against `url`; one point per rate, stopping after the
    first rate below half the target (higher rates only queue more)."""
    points = []
    for rate in sorted(rates):
        requests: list[BenchRequest] = make_requests(rate)
        results, duration = asyncio.run(run_benchmark(url, requests, model=model, request_rate=rate,
                                                      arrival="poisson", warmup=0, seed=seed, progress=False))
        att = attainment(results, ttft_ms, tpot_ms)
        s = summarize(results, duration, ttft_ms, tpot_ms)
        points.append({"rate": rate, "attainment": round(att, 4), "summary": s})
        p90 = {k: s[f"{k}_ms"]["p90"] or 0.0 for k in ("ttft", "tpot")}
        print(f"[{name}] rate {rate:g} req/s: {att:.0%} of {len(results)} requests within TTFT {ttft_ms:.0f} ms and "
              f"TPOT {tpot_ms:.0f} ms (TTFT p90 {p90['ttft']:.0f} ms, TPOT p90 {p90['tpot']:.0f} ms)",
              file=sys.stderr, flush=True)
        if att < TARGET / 2:
            break
    return points
