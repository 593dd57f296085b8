"""Each policy's choice distribution, through a real router."""

from __future__ import annotations

from tests.harness.client import get_json, wait_until


def _counts(ws):
    return [len(w.requests()) for w in ws]


def test_random_uses_all_workers(workers, make_router):
    r = make_router(workers["p"], workers["d"], "--policy", "random")
    for _ in range(40):
        assert r.post("/generate", {"text": "x"})[0] == 200
    for counts in (_counts(workers["p"]), _counts(workers["d"])):
        assert sum(counts) == 40 and min(counts) >= 6  # P(fail) ~ 1e-5 per side


def test_round_robin_alternates(workers, make_router):
    r = make_router(workers["p"], workers["d"], "--policy", "round_robin")
    for _ in range(10):
        assert r.post("/generate", {"text": "x"})[0] == 200
    # both legs go out at once and the answer is the decode leg's: the last prefill leg may still be on its
    # way
    wait_until(lambda: sum(_counts(workers["p"])) == 10, timeout=10, what="every prefill leg received")
    assert _counts(workers["p"]) == [5, 5] and _counts(workers["d"]) == [5, 5]
    order = sorted((req["t"], w.url) for w in workers["d"] for req in w.requests())
    assert all(a[1] != b[1] for a, b in zip(order, order[1:], strict=False))


def test_power_of_two_prefers_low_load(workers, make_router):
    p0, d1 = workers["p"][0], workers["d"][1]
    p0.config(load=5000)
    d1.config(load=9000)
    r = make_router(workers["p"], workers["d"], "--prefill-policy", "power_of_two", "--decode-policy",
                    "power_of_two", "--load-check-interval-secs", "0.1")
    wait_until(lambda: {x["url"]: x["load"] for x in get_json(r.url + "/workers")["workers"]}.get(d1.url)
               == 9000, what="loads polled")
    for _ in range(12):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert _counts(workers["p"]) == [0, 12] and _counts(workers["d"]) == [12, 0]


def test_cache_aware_follows_prefix_then_balances(workers, make_router):
    r = make_router(workers["p"], workers["d"], "--policy", "cache_aware", "--cache-threshold", "0.5")
    a = "You are a helpful assistant for astronomy questions. " * 4
    b = "Translate the following legal contract into French, carefully. " * 4
    for i in range(5):
        assert r.post("/generate", {"text": a + f"question {i}"})[0] == 200
    for i in range(5):
        assert r.post("/generate", {"text": b + f"clause {i}"})[0] == 200
    for ws in (workers["p"], workers["d"]):
        by_prefix = {}
        for w in ws:
            for req in w.requests():
                by_prefix.setdefault(req["body"]["text"][:20], set()).add(w.url)
        # each prefix sticks to one worker, and the second prefix went to the other (empty) worker
        assert all(len(v) == 1 for v in by_prefix.values()) and len(set.union(*by_prefix.values())) == 2
