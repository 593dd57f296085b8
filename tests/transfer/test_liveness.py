"""transfer/liveness.py with a made-up clock: a peer is dead after a window of silence counted in the
checking process's running time, so a pause of the process itself is not silence (interval 0.3 s,
window 1.2 s, checks every 50 ms as the managers' timers make them)."""

from __future__ import annotations

from transfer.liveness import Liveness


def ticks(lv: Liveness, live: list[str], start: float, end: float, step: float = 0.05) -> dict[str, float]:
    """Check every `step` from `start` to `end`; the first time each peer was found dead."""
    dead: dict[str, float] = {}
    t = start
    while t <= end + 1e-9:
        for addr, _ in lv.check(live, t):
            dead.setdefault(addr, round(t, 2))
        t += step
    return dead


def test_a_silent_peer_is_dead_after_the_window_and_a_talking_one_never():
    lv = Liveness(0.3, 1.2)
    lv.heard("a", 0.0)  # not watched yet: not recorded
    assert lv.check(["a", "b"], 0.0) == [] and len(lv) == 2
    t = 0.0
    while t < 5.0:
        t += 0.05
        lv.heard("b", t)
        found = dict(lv.check(["a", "b"], t))
        if found:
            break
    assert set(found) == {"a"} and 1.2 < found["a"] < 1.25 + 1e-6 and 1.2 < t < 1.25 + 1e-6


def test_a_pause_of_the_checking_process_counts_as_one_interval():
    lv = Liveness(0.3, 1.2)
    assert ticks(lv, ["a"], 0.0, 0.5) == {}
    # the process is stopped for 10 s; on waking it has heard nothing yet (the peer's pings wait in
    # its socket): 0.5 s of silence + one interval for the pause, not 10.5 s
    assert lv.check(["a"], 10.5) == [] and lv.paused_s == 10.5 - 0.5 - 0.3
    lv.heard("a", 10.5)  # it reads them
    assert ticks(lv, ["a"], 10.55, 11.5) == {}
    # still silent after that: dead a window after it was last heard
    dead = ticks(lv, ["a"], 11.55, 13.0)
    assert list(dead) == ["a"] and 11.7 <= dead["a"] <= 11.75


def test_a_starved_process_still_finds_a_dead_peer():
    # checks 2 s apart (every one a "pause"): each adds one interval of silence, so 1.2 s needs five
    lv = Liveness(0.25, 1.2)
    found = {}
    for k in range(10):
        found.update(dict(lv.check(["a"], 2.0 * k)))
        if found:
            break
    assert found and k == 5


def test_peers_leave_the_record_when_their_rooms_end_and_forget_drops_one():
    lv = Liveness(0.3, 1.2)
    lv.check(["a", "b"], 0.0)
    lv.heard("a", 0.1)
    lv.check(["b"], 0.2)  # a's rooms ended
    assert not lv.watching("a") and lv.watching("b")
    lv.heard("a", 0.25)  # a stranger's message is not recorded
    assert not lv.watching("a")
    # a comes back with a new room: watched afresh from now, not from its old record
    assert lv.check(["a", "b"], 1.0) == [] and lv.watching("a")
    lv.forget("b")
    assert len(lv) == 1
    dead = ticks(lv, ["a"], 1.05, 3.0)
    assert list(dead) == ["a"] and 2.2 <= dead["a"] <= 2.25
