"""SLO attainment and the highest rate that keeps 90 % of requests within both SLOs (bench/slo.py)."""

from __future__ import annotations

from bench import slo
from bench.serve import RequestResult


def result(ttft: float, tpot: float, ok: bool = True, out: int = 11) -> RequestResult:
    return RequestResult(ok=ok, tag="x", prompt_len=5, output_len=out, ttft=ttft, latency=ttft + (out - 1) * tpot)


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
