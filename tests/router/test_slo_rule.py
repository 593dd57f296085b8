"""The SLO planner's rule (router/slo_rule.py) replayed on recorded windows (tests/data/planner_figures.json):
a prompt-heavy stretch, a calm one, a window with too few requests, an output-heavy stretch, noise around
both SLOs, a decode pool short of KV and both pools short. SLOs: TTFT 1 s, ITL 50 ms; windows 5 s apart."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from router.slo_rule import DECODE_TO_PREFILL, HOLD, PREFILL_TO_DECODE, Decision, Figures, SloRule

DATA = Path(__file__).resolve().parent.parent / "data" / "planner_figures.json"
D2P, P2D = DECODE_TO_PREFILL, PREFILL_TO_DECODE


def load(stretch: str | None = None) -> list[Figures]:
    rows = json.loads(DATA.read_text())
    return [Figures(**{k: v for k, v in r.items() if k != "stretch"}) for r in rows
            if stretch is None or r["stretch"] == stretch]


def rule(**kw) -> SloRule:
    return SloRule(1.0, 0.05, **kw)


def replay(r: SloRule, windows: list[Figures]) -> list[Decision]:
    """Decide every window, reporting each move as carried out (the planner's part)."""
    out = []
    for f in windows:
        d = r.decide(f)
        if d.action != HOLD:
            r.moved(d.action, f.at)
        out.append(d)
    return out


def at(f: Figures, t: float) -> Figures:
    return dataclasses.replace(f, at=t)


def test_recorded_trace_decisions():
    decisions = replay(rule(), load())
    expected = [HOLD, D2P, HOLD, HOLD,  # prompt-heavy: the move at window `patience`, then a cooldown
                HOLD, HOLD,  # calm, too few requests
                HOLD, HOLD, HOLD, P2D, HOLD,  # output-heavy: the reversal waits 2x the cooldown
                *[HOLD] * 8,  # noise never moves
                HOLD, P2D, HOLD, HOLD,  # decode KV low: a move, then prefill is at its minimum
                HOLD, HOLD]  # both pools short
    assert [d.action for d in decisions] == expected
    reasons = [d.reason for d in decisions]
    assert "prefill short" in reasons[0] and "for 1 window (patience 2)" in reasons[0]
    assert "for 2 windows (patience 2)" in reasons[1] and "decode can spare a node" in reasons[1]
    assert "for 1 window (patience 2)" in reasons[2]  # the move started the streak over
    assert "cooldown" in reasons[3] and "10s ago" in reasons[3] and "needs 20s" in reasons[3]
    assert reasons[4].startswith("both SLOs met")
    assert reasons[5].startswith("too few requests")
    assert "decode short (ITL over its SLO)" in reasons[6]
    for i, ago in ((7, 30), (8, 35)):
        assert "reverses the last move" in reasons[i] and f"{ago}s ago" in reasons[i]
        assert "needs 40s" in reasons[i]
    assert "KV free under 10%" in reasons[20]
    assert "prefill is at its minimum (1 <= 1)" in reasons[22]
    assert all(r.startswith("both pools short: more nodes needed") for r in reasons[23:])
    # every reason names the figures it was made on
    assert all("TTFT p90" in r and "queues prefill" in r and "P/" in r for r in reasons)
    assert "TTFT p90 1.600s (1.60x SLO)" in reasons[0] and "3P/2D" in reasons[2]


@pytest.mark.parametrize("patience", [1, 2, 3, 4])
def test_first_move_at_window_patience(patience):
    f = load("prompt_heavy")[0]
    r = rule(patience=patience)
    actions = [r.decide(at(f, 5.0 * i)).action for i in range(6)]
    assert actions.index(D2P) == patience - 1
    assert set(actions[:patience - 1]) <= {HOLD}


def test_a_move_not_reported_is_asked_again():
    """decide() does not assume the move happened: without moved() there is no cooldown to wait."""
    r = rule()
    f = load("prompt_heavy")[0]
    assert [r.decide(at(f, t)).action for t in (0, 5, 10)] == [HOLD, D2P, D2P]
    r.moved(D2P, 10)
    assert r.decide(at(f, 15)).action == HOLD  # a fresh streak
    assert r.prefill_streak == 1


def test_cooldown_boundary_same_direction():
    r = rule(cooldown_s=20)
    f = load("prompt_heavy")[0]
    r.moved(D2P, 100.0)
    r.decide(at(f, 105))
    assert r.decide(at(f, 119.9)).action == HOLD
    assert "follows the last move" in r.decide(at(f, 119.99)).reason
    assert r.decide(at(f, 120.0)).action == D2P


def test_reversal_needs_twice_the_cooldown():
    r = rule(cooldown_s=20)
    f = load("output_heavy")[1]
    r.moved(D2P, 0.0)
    actions = [r.decide(at(f, t)).action for t in (25, 30, 39.9, 40)]
    assert actions == [HOLD, HOLD, HOLD, P2D]  # 25 s and 30 s: past one cooldown, not two


def test_noise_never_moves_but_its_windows_would():
    noisy = load("noisy")
    assert [d.action for d in replay(rule(), noisy)] == [HOLD] * len(noisy)
    # each breached window alone, seen twice in a row, is enough to move: only the alternation holds
    moving = {D2P: 0, P2D: 0}
    for f in noisy:
        r = rule()
        r.decide(f)
        d = r.decide(at(f, f.at + 5))
        if d.action != HOLD:
            moving[d.action] += 1
    assert moving == {D2P: 3, P2D: 3}


def test_too_few_requests_neither_resets_nor_advances_the_streak():
    heavy, few = load("prompt_heavy")[0], load("few_requests")[0]
    r = rule()
    assert [d.action for d in replay(r, [at(heavy, 0), at(few, 5), at(heavy, 10)])] == [HOLD, HOLD, D2P]
    r = rule()
    assert [d.action for d in replay(r, [at(few, 0), at(few, 5), at(heavy, 10)])] == [HOLD, HOLD, HOLD]
    assert r.prefill_streak == 1
    r = rule(min_requests=1)  # with a lower bar the same window counts (TTFT 3 s, the prefill queue deeper)
    assert r.decide(few).reason.startswith("prefill short")


def test_a_calm_window_resets_the_streak():
    heavy, calm = load("prompt_heavy")[0], load("calm")[0]
    actions = [d.action for d in replay(rule(), [at(heavy, 0), at(calm, 5), at(heavy, 10), at(heavy, 15)])]
    assert actions == [HOLD, HOLD, HOLD, D2P]


def test_min_counts_respected():
    heavy = load("prompt_heavy")[0]  # 2P/3D, prefill short
    for min_decode, n, expected in ((1, 1, HOLD), (3, 3, HOLD), (2, 3, D2P)):
        r = rule(min_decode=min_decode)
        f = dataclasses.replace(heavy, num_decode=n, itl_p90=0.001)
        d = replay(r, [f, at(f, 5)])[-1]
        assert d.action == expected, (min_decode, n, d.reason)
        if expected == HOLD:
            assert f"decode is at its minimum ({n} <= {min_decode})" in d.reason
    out = load("output_heavy")[0]  # decode short, 3P
    d = replay(rule(min_prefill=3), [out, at(out, 5)])[-1]
    assert d.action == HOLD and "prefill is at its minimum" in d.reason


def test_donor_slack_respected():
    heavy = load("prompt_heavy")[0]  # 3 decode workers: r_i x 3/2 must be <= slack
    for itl, expected in ((0.02, D2P), (0.0266, D2P), (0.027, HOLD), (0.045, HOLD)):
        f = dataclasses.replace(heavy, itl_p90=itl)
        d = replay(rule(), [f, at(f, 5)])[-1]
        assert d.action == expected, (itl, d.reason)
    f = dataclasses.replace(heavy, itl_p90=0.03)  # 0.9x after the move
    d = replay(rule(), [f, at(f, 5)])[-1]
    assert d.action == HOLD and "would be 0.90x > slack 0.8" in d.reason
    assert replay(rule(slack=0.95), [f, at(f, 5)])[-1].action == D2P
    # the decode donor's ratio unknown (no TPOT sample): no evidence it can spare one
    f = dataclasses.replace(heavy, itl_p90=None)
    d = replay(rule(), [f, at(f, 5)])[-1]
    assert d.action == HOLD and "latency is unknown" in d.reason


def test_donor_queue_must_stay_small():
    out = load("output_heavy")[0]  # decode short on ITL, decode queue 1.5 per worker, 3 prefill workers
    for pq, expected in ((0.2, P2D), (1.0, P2D), (1.1, HOLD)):
        f = dataclasses.replace(out, prefill_queue=pq)
        d = replay(rule(), [f, at(f, 5)])[-1]
        assert d.action == expected, (pq, d.reason)
    f = dataclasses.replace(out, prefill_queue=1.2, decode_queue=0.0)  # 1.8 > max(0, idle_queue 1)
    d = replay(rule(), [f, at(f, 5)])[-1]
    assert d.action == HOLD and "queue would be 1.8 per worker" in d.reason
    assert replay(rule(idle_queue=2.0), [f, at(f, 5)])[-1].action == P2D


def test_decode_short_when_ttft_waits_on_decode_slots():
    f = Figures(ttft_p90=1.5, itl_p90=0.02, requests=20, num_prefill=3, num_decode=3, prefill_queue=0.1,
                decode_queue=3.0, decode_kv_free=0.5, at=0.0)
    d = replay(rule(), [f, at(f, 5)])
    assert d[0].reason.startswith("decode short (TTFT over its SLO with requests waiting for a decode slot)")
    # the TTFT of 1.5x is the decode slots' doing: the prefill pool's short queue lets it spare a node
    assert d[1].action == PREFILL_TO_DECODE, d[1].reason
    # ... but not when its own queue is deep too
    g = dataclasses.replace(f, prefill_queue=2.5)
    d = replay(rule(), [g, at(g, 5)])
    assert d[1].action == HOLD and "prefill's queue would be" in d[1].reason, d[1].reason


def test_a_backlog_moves_a_node_before_the_slo_breaks():
    """The p90s count finished requests only: a decode queue of 6 per worker is a shortage already; a
    backlog on both sides is a hold; one under `backlog` is none."""
    f = Figures(ttft_p90=1.0, itl_p90=0.02, requests=20, num_prefill=2, num_decode=2, prefill_queue=0.0,
                decode_queue=6.0, decode_kv_free=0.8, at=0.0)
    d = replay(rule(), [f, at(f, 5)])
    assert d[0].action == HOLD and "decode short (a backlog of 6.0 per worker)" in d[0].reason, d[0].reason
    assert d[1].action == PREFILL_TO_DECODE, d[1].reason
    both = dataclasses.replace(f, prefill_queue=5.0)
    assert replay(rule(patience=1), [both])[0].reason.startswith("both pools short")
    calm = dataclasses.replace(f, decode_queue=3.5)
    assert replay(rule(patience=1), [calm])[0].reason.startswith("both SLOs met")


def test_unknown_figures_are_not_breaches():
    f = Figures(ttft_p90=None, itl_p90=None, requests=20, num_prefill=2, num_decode=2, prefill_queue=3.0,
                decode_queue=3.0, decode_kv_free=None, at=0.0)
    d = rule().decide(f)
    assert d.action == HOLD and d.reason.startswith("no SLO breached (a figure is unknown)")
    assert "TTFT p90 - (no sample), ITL p90 - (no sample)" in d.reason and "decode KV free -" in d.reason


def test_both_short_holds_whatever_the_counts():
    for f in load("both_short"):
        g = dataclasses.replace(f, num_prefill=4, num_decode=4)
        d = replay(rule(patience=1), [g])[0]
        assert d.action == HOLD and d.reason.startswith("both pools short")


def test_as_dict_is_json():
    f = load()[0]
    d = rule().decide(f)
    back = json.loads(json.dumps(d.as_dict()))
    assert back["action"] == HOLD and back["figures"] == f.as_dict()
    assert Figures(**back["figures"]) == f


def test_bad_arguments_refused():
    for kw in ({"patience": 0}, {"slack": 0}, {"kv_floor": 1.5}, {"min_decode": 0}, {"cooldown_s": -1}):
        with pytest.raises(ValueError):
            rule(**kw)
    with pytest.raises(ValueError):
        SloRule(0, 0.05)
    with pytest.raises(ValueError):
        rule().moved(HOLD, 0.0)
