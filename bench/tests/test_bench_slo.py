"""SLO attainment and the highest rate that keeps 90 % of requests within both SLOs (bench/slo.py)."""

from __future__ import annotations

from bench import slo
from bench.serve import RequestResult


def result(ttft: float, tpot: float, ok: bool = True, out: int = 11) -> RequestResult:
    return RequestResult(ok=ok, tag="x", prompt_len=5, output_len=out, ttft=ttft,
                         latency=ttft + (out - 1) * tpot)


def test_a_request_attains_when_both_ttft_and_tpot_are_within():
    assert slo.attains(result(1.0, 0.05), 2000, 100)
    assert not slo.attains(result(2.5, 0.05), 2000, 100)  # first token too late
    assert not slo.attains(result(1.0, 0.2), 2000, 100)  # too slow afterwards
    assert not slo.attains(result(0.1, 0.01, ok=False), 2000, 100)  # failed
    assert slo.attains(result(1.0, 0.0, out=1), 2000, 100)  # one token: no TPOT to miss
    rs = [result(1.0, 0.05)] * 9 + [result(3.0, 0.05)]
    assert slo.attainment(rs, 2000, 100) == 0.9 and slo.attainment([], 2000, 100) == 0.0


def test_max_rate_interpolates_the_crossing_of_90_percent():
    assert slo.max_rate([(0.5, 1.0), (1.0, 0.95), (2.0, 0.5)]) == 1.0 + 1.0 * (0.95 - 0.9) / (0.95 - 0.5)
    assert abs(slo.max_rate([(2.0, 0.5), (0.5, 1.0)]) - 0.8) < 1e-9  # order does not matter
    assert slo.max_rate([(0.5, 1.0), (1.0, 0.9)]) == 1.0  # every rate attains: the highest swept
    assert slo.max_rate([(0.5, 0.8), (1.0, 0.95)]) == 0.0  # the lowest already misses
    assert slo.max_rate([]) == 0.0


def test_attainment_is_fitted_non_increasing_before_the_crossing():
    # measured on the AVX2 host (colocated node): 0.75 req/s attained more than 0.5 did
    pts = [(0.25, 1.0), (0.5, 0.84), (0.75, 0.94), (1.0, 0.47), (1.25, 0.22)]
    assert [round(a, 9) for _, a in slo.monotone(pts)] == [1.0, 0.89, 0.89, 0.47, 0.22]
    # not 0.41 (first miss), not 0.77 (last hit)
    assert abs(slo.max_rate(pts) - (0.25 + 0.25 * 0.1 / 0.11)) < 1e-9
    assert [round(a, 9) for _, a in slo.monotone([(2, 0.5), (1, 0.4), (3, 0.9)])] == [0.6, 0.6, 0.6]
    assert slo.monotone(pts[:1]) == pts[:1] and slo.monotone([]) == []


def sweep_of(attainment_at, rates, min_rate=0.1):
    seen = []

    def measure(rate):
        seen.append(rate)
        return {"rate": rate, "attainment": attainment_at(rate)}

    return [p["rate"] for p in slo.rates_to_sweep(measure, rates, min_rate)], seen


def test_sweep_stops_past_the_knee_and_goes_below_a_lowest_rate_that_misses():
    # attains up to 1 req/s, then falls: the rates past half the target are not run
    rates, seen = sweep_of(lambda r: 1.0 if r <= 1 else 0.3, [2, 0.5, 1, 3])
    assert rates == seen == [0.5, 1, 2]
    # a miss at the lowest rate that a higher one makes up for (89 % at both once fitted) still halves
    noisy = {0.25: 1.0, 0.5: 0.84, 0.75: 0.94, 1: 0.3}
    assert sweep_of(noisy.get, [0.5, 0.75, 1])[1] == [0.5, 0.75, 1, 0.25]
    assert sweep_of({0.5: 0.95, 0.75: 0.91, 1: 0.3}.get, [0.5, 0.75, 1])[1] == [0.5, 0.75, 1]
    # misses even the lowest rate: halved until it attains, and the crossing is interpolated from there
    att = {0.125: 0.95, 0.25: 0.8, 0.5: 0.7, 1: 0.3}
    rates, seen = sweep_of(att.get, [0.5, 1, 2])
    assert seen == [0.5, 1, 0.25, 0.125] and rates == [0.125, 0.25, 0.5, 1]
    assert 0.125 < slo.max_rate([(r, att[r]) for r in rates]) < 0.25
    # never attains: halved down to the floor, no further, and the figure stays 0
    rates, seen = sweep_of(lambda r: 0.5, [0.5, 1], min_rate=0.1)
    assert seen == [0.5, 1, 0.25, 0.125] and slo.max_rate([(r, 0.5) for r in rates]) == 0.0


def test_rounds_pool_per_rate_and_weigh_each_rate_by_its_requests():
    # two rounds of 32 requests: the second stopped earlier and halved below its lowest rate
    r1 = [{"rate": 0.5, "attainment": 1.0, "requests": 32}, {"rate": 1.0, "attainment": 0.75, "requests": 32},
          {"rate": 2.0, "attainment": 0.25, "requests": 32}]
    r2 = [{"rate": 0.25, "attainment": 1.0, "requests": 32},
          {"rate": 0.5, "attainment": 0.875, "requests": 32},
          {"rate": 1.0, "attainment": 0.375, "requests": 32}]
    pts = slo.pooled([r1, r2])
    assert [(p["rate"], p["attainment"], p["requests"]) for p in pts] == [
        (0.25, 1.0, 32), (0.5, 0.9375, 64), (1.0, 0.5625, 64), (2.0, 0.25, 32)]
    assert abs(slo.max_rate(slo.points_of(pts)) - (0.5 + 0.5 * 0.0375 / 0.375)) < 1e-9
    # a violator is pooled with its neighbour by weight: 64 requests at 80 % and 32 at 95 % fit as 85 %
    assert [round(a, 9) for _, a in slo.monotone([(0.5, 0.8, 64), (1.0, 0.95, 32)])] == [0.85, 0.85]
    assert slo.pooled([r1]) == [{k: p[k] for k in ("rate", "attainment", "requests")} for p in r1]
    assert slo.pooled([]) == []
