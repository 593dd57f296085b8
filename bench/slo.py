"""SLO attainment over a sweep of request rates, the way DistServe compares serving systems (used by
`pdserve bench compare`).

At each rate the same kind of requests arrive as a Poisson process; a request attains the SLOs when
its TTFT and its TPOT are both within them (a failed request never does). The figure of merit is the
highest rate at which at least `target` (90 %) of the requests attain them. The measured attainments
are first fitted non-increasing in the rate (`monotone`: 84 % at 0.5 req/s and 94 % at 0.75 become
89 % at both), then between the last rate that attains the target and the first that does not, the
crossing is interpolated linearly; when every rate does, it is the highest rate swept (a lower bound).
When the lowest rate misses, `rates_to_sweep` halves it until one attains the target or the rate would
fall below a floor; only then is the figure 0.

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


def monotone(points: list[tuple]) -> list[tuple[float, float]]:
    """(rate, attainment) sorted by rate, the attainments replaced by their closest non-increasing fit
    (pool adjacent violators, each point weighted by its third element, the requests it measured, when it
    has one, else equally). A queue only grows with the rate, so a rate that attains more than a lower one
    did is noise, not capacity: the two are averaged instead of either being taken at its word."""
    points = sorted(points)
    blocks: list[list[float]] = []  # [weighted sum, weight, points] of pooled neighbours
    for p in points:
        w = p[2] if len(p) > 2 else 1
        blocks.append([p[1] * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, weight, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += n
    fitted = [b[0] / b[1] for b in blocks for _ in range(b[2])]
    return [(p[0], att) for p, att in zip(points, fitted, strict=True)]


def pooled(rounds: list[list[dict]]) -> list[dict]:
    """The points of several sweeps of one setup (`--rounds`) as one: per rate, the attainment over every
    request any round sent at that rate (a rate only some rounds reached counts for the requests they
    sent), with "requests" the count, for `monotone` to weight."""
    by_rate: dict[float, list[float]] = {}
    for points in rounds:
        for p in points:
            n = p.get("requests", 1)
            acc = by_rate.setdefault(p["rate"], [0.0, 0])
            acc[0] += p["attainment"] * n
            acc[1] += n
    return [{"rate": rate, "attainment": round(total / n, 4), "requests": n}
            for rate, (total, n) in sorted(by_rate.items())]


def points_of(sweep_points: list[dict]) -> list[tuple[float, float, int]]:
    """`max_rate`'s (rate, attainment, requests) points from a sweep's dicts."""
    return [(p["rate"], p["attainment"], p.get("requests", 1)) for p in sweep_points]


def max_rate(points: list[tuple], target: float = TARGET) -> float:
    """The highest rate at which attainment >= target, from (rate, attainment[, requests]) points fitted
    non-increasing (`monotone`)."""
    points = monotone(points)
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


def rates_to_sweep(measure, rates: list[float], min_rate: float) -> list[dict]:
    """Points `measure(rate)` (a dict with "rate" and "attainment") over `rates` in increasing order,
    stopping after the first below half the target (higher rates only queue more). When even the lowest
    rate misses the target (after `monotone`), the rate is halved until one attains it or it would fall
    below `min_rate`: a setup that cannot keep the lowest rate swept still has a highest rate, and
    `max_rate` a crossing to interpolate, instead of a 0 that no ratio can be taken of."""
    points = []
    for rate in sorted(rates):
        points.append(measure(rate))
        if points[-1]["attainment"] < TARGET / 2:
            break
    while points and max_rate(points_of(points)) == 0 and points[0]["rate"] / 2 >= min_rate:
        points.insert(0, measure(points[0]["rate"] / 2))
    return points


def sweep(url: str, model: str, make_requests, rates: list[float], ttft_ms: float, tpot_ms: float, seed: int,
          name: str, min_rate: float) -> list[dict]:
    """Run `make_requests(rate)` at each rate against `url` (`rates_to_sweep` picks the rates); one point
    per rate."""

    def measure(rate: float) -> dict:
        requests: list[BenchRequest] = make_requests(rate)
        results, duration = asyncio.run(run_benchmark(url, requests, model=model, request_rate=rate,
                                                      arrival="poisson", warmup=0, seed=seed, progress=False))
        att = attainment(results, ttft_ms, tpot_ms)
        s = summarize(results, duration, ttft_ms, tpot_ms)
        p90 = {k: s[f"{k}_ms"]["p90"] or 0.0 for k in ("ttft", "tpot")}
        print(f"[{name}] rate {rate:g} req/s: {att:.0%} of {len(results)} requests within TTFT {ttft_ms:.0f} "
              f"ms and TPOT {tpot_ms:.0f} ms (TTFT p90 {p90['ttft']:.0f} ms, TPOT p90 {p90['tpot']:.0f} ms)",
              file=sys.stderr, flush=True)
        return {"rate": rate, "attainment": round(att, 4), "requests": len(results), "summary": s}

    return rates_to_sweep(measure, rates, min_rate)
