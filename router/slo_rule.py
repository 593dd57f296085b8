"""The SLO planner's decision rule: given one observation window, move a node between the prefill and the
decode pool, or hold. Pure: no I/O, no clock, no asyncio (the planner, router/planner.py, feeds it).

A window (`Figures`) holds the router's TTFT and ITL p90 over its last seconds, how many streamed
requests those figures rest on, the workers of each pool in rotation, each pool's mean queue per worker
and the decode pool's lowest KV headroom. The rule, in order:

1. **Too few samples.** A window with fewer than `min_requests` finished streams is no evidence: hold,
   and leave every streak as it was (neither advanced nor reset).
2. **Ratios.** r_t = ttft_p90 / ttft_slo and r_i = itl_p90 / itl_slo. A figure that is None (no sample)
   makes that side unknown, never breached.
3. **Which pool is short.**
   * decode is short when r_i > 1 (tokens come too slowly), or the decode KV headroom is under
     `kv_floor` (decode nodes are about to stop taking requests), or r_t > 1 while the decode queue is
     deeper than the prefill queue (TTFT breached because requests wait for a decode slot, not for a
     prefill);
   * prefill is short when r_t > 1 and the prefill queue is at least as deep as the decode queue;
   * either is short when its queue holds `backlog` or more requests per worker, SLOs met or not: the
     p90s count finished requests only, so a backlog shows in the queues first, and a move made while it
     builds has fewer requests to catch up on (both backed up: both short, so a hold).
   Both short: hold ("both pools short: more nodes needed"); moving a node would only move the breach.
   Neither: hold, and both streaks start over.
4. **Hysteresis in.** Each pool has a streak: consecutive counted windows in which it was short; a
   window in which it was not short resets it. A move needs the streak to reach `patience`. A noisy
   load that crosses the SLO every other window never builds a streak, so it never moves a node.
5. **The donor must afford it.** The other pool gives the node. It must keep more than its minimum
   (`min_prefill` / `min_decode`) and, after losing one of its n nodes, its own SLO must still hold with
   room: its ratio scaled by n / (n - 1) (r_t for a prefill donor, r_i for a decode donor) must be at
   most `slack`; an unknown ratio is not evidence that it can spare one. While the decode queue is the
   deeper, TTFT includes the wait for a decode slot and says nothing of the prefill pool, so then only
   the queue below judges a prefill donor. Its queue scaled the same way must stay small: at most the
   short pool's queue, or at most `idle_queue` requests per worker.
6. **Cooldown.** No move within `cooldown_s` of the last one (the planner reports a move done through
   `moved()`); a move that reverses the last one waits twice as long, so the pools cannot flap. Streaks
   keep counting through a cooldown, so a shortage that outlasts it moves a node at once.

`decide()` never assumes a move happened: only `moved()` records one (its time starts the cooldown) and
starts both streaks over, so the next move needs `patience` fresh windows seen with the new split. A
move that failed is not reported and the rule asks for it again at the next window.

Every decision, a hold included, carries a sentence naming the figures it was made on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PREFILL_TO_DECODE = "prefill_to_decode"
DECODE_TO_PREFILL = "decode_to_prefill"
HOLD = "hold"
MOVES = (PREFILL_TO_DECODE, DECODE_TO_PREFILL)
_REVERSE = {PREFILL_TO_DECODE: DECODE_TO_PREFILL, DECODE_TO_PREFILL: PREFILL_TO_DECODE}


@dataclass
class Figures:
    """One observation window, as the router saw it."""

    ttft_p90: float | None  # seconds to a stream's first byte
    itl_p90: float | None  # seconds per output token (the router's TPOT)
    requests: int  # streamed requests finished in the window
    num_prefill: int  # workers in rotation
    num_decode: int
    prefill_queue: float  # mean requests per prefill worker waiting to be computed
    decode_queue: float  # mean requests per decode worker waiting for a decode slot
    decode_kv_free: float | None  # the lowest fraction of free KV tokens among decode workers, 0..1
    at: float  # time.monotonic() of the window's end

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Decision:
    action: str  # PREFILL_TO_DECODE, DECODE_TO_PREFILL or HOLD
    reason: str
    figures: Figures

    def as_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "figures": self.figures.as_dict()}


def _ratio(value: float | None, slo: float) -> float | None:
    return None if value is None else value / slo


def _figure(value: float | None, ratio: float | None, digits: int) -> str:
    return "- (no sample)" if value is None or ratio is None else f"{value:.{digits}f}s ({ratio:.2f}x SLO)"


def summary(f: Figures, r_t: float | None, r_i: float | None) -> str:
    """The figures of a window in a few words (the second half of every reason)."""
    kv = "-" if f.decode_kv_free is None else f"{100 * f.decode_kv_free:.0f}%"
    return (f"TTFT p90 {_figure(f.ttft_p90, r_t, 3)}, ITL p90 {_figure(f.itl_p90, r_i, 4)}, queues prefill "
            f"{f.prefill_queue:.1f} / decode {f.decode_queue:.1f} per worker, decode KV free {kv}, "
            f"{f.num_prefill}P/{f.num_decode}D, {f.requests} requests")


class SloRule:
    def __init__(self, ttft_slo: float, itl_slo: float, *, patience: int = 2, slack: float = 0.8,
                 cooldown_s: float = 20.0, min_requests: int = 5, kv_floor: float = 0.1,
                 min_prefill: int = 1, min_decode: int = 1, idle_queue: float = 1.0,
                 backlog: float = 4.0) -> None:
        for name, v in (("ttft_slo", ttft_slo), ("itl_slo", itl_slo), ("slack", slack)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if cooldown_s < 0 or min_requests < 0 or idle_queue < 0 or backlog <= 0:
            raise ValueError("cooldown_s, min_requests and idle_queue must be >= 0, backlog > 0")
        if not 0 <= kv_floor <= 1:
            raise ValueError(f"kv_floor must be within 0..1, got {kv_floor}")
        if min_prefill < 1 or min_decode < 1:
            raise ValueError("min_prefill and min_decode must be >= 1 (a pool cannot be emptied)")
        self.ttft_slo, self.itl_slo = ttft_slo, itl_slo
        self.patience, self.slack, self.cooldown_s = patience, slack, cooldown_s
        self.min_requests, self.kv_floor, self.idle_queue = min_requests, kv_floor, idle_queue
        self.backlog = backlog
        self.min_prefill, self.min_decode = min_prefill, min_decode
        self.prefill_streak = 0  # consecutive counted windows with the prefill pool short
        self.decode_streak = 0
        self.last_action: str | None = None  # the last move carried out
        self.last_move_at: float | None = None

    def moved(self, action: str, at: float) -> None:
        """The planner carried `action` out at `at` (time.monotonic()): the cooldown starts, the streaks
        start over."""
        if action not in MOVES:
            raise ValueError(f"not a move: {action!r}")
        self.last_action, self.last_move_at = action, at
        self.prefill_streak = self.decode_streak = 0

    def decide(self, f: Figures) -> Decision:
        r_t, r_i = _ratio(f.ttft_p90, self.ttft_slo), _ratio(f.itl_p90, self.itl_slo)
        facts = summary(f, r_t, r_i)

        def hold(why: str) -> Decision:
            return Decision(HOLD, f"{why}; {facts}", f)

        if f.requests < self.min_requests:
            return hold(f"too few requests to judge ({f.requests} < {self.min_requests}): streaks kept as "
                        "they were")
        ttft_over = r_t is not None and r_t > 1
        itl_over = r_i is not None and r_i > 1
        kv_low = f.decode_kv_free is not None and f.decode_kv_free < self.kv_floor
        prefill_backlog, decode_backlog = f.prefill_queue >= self.backlog, f.decode_queue >= self.backlog
        prefill_why = [why for cond, why in (
            (ttft_over and f.prefill_queue >= f.decode_queue, "TTFT over its SLO with the prefill queue the "
             "deeper"),
            (prefill_backlog and not ttft_over, f"a backlog of {f.prefill_queue:.1f} per worker")) if cond]
        prefill_short = bool(prefill_why)
        decode_why = [why for cond, why in (
            (itl_over, "ITL over its SLO"),
            (kv_low, f"decode KV free under {100 * self.kv_floor:.0f}%"),
            (ttft_over and f.decode_queue > f.prefill_queue, "TTFT over its SLO with requests waiting for "
             "a decode slot"),
            (decode_backlog and not ttft_over, f"a backlog of {f.decode_queue:.1f} per worker")) if cond]
        decode_short = bool(decode_why)
        self.prefill_streak = self.prefill_streak + 1 if prefill_short else 0
        self.decode_streak = self.decode_streak + 1 if decode_short else 0
        if prefill_short and decode_short:
            return hold("both pools short: more nodes needed")
        if not (prefill_short or decode_short):
            return hold("both SLOs met" if r_t is not None and r_i is not None
                        else "no SLO breached (a figure is unknown)")
        if prefill_short:
            needy, donor, action, streak = "prefill", "decode", DECODE_TO_PREFILL, self.prefill_streak
            short_why = ", ".join(prefill_why)
            n, minimum, donor_ratio = f.num_decode, self.min_decode, r_i
            donor_q, needy_q = f.decode_queue, f.prefill_queue
        else:
            needy, donor, action, streak = "decode", "prefill", PREFILL_TO_DECODE, self.decode_streak
            short_why = ", ".join(decode_why)
            n, minimum, donor_ratio = f.num_prefill, self.min_prefill, r_t
            donor_q, needy_q = f.prefill_queue, f.decode_queue
            if f.decode_queue > f.prefill_queue:
                donor_ratio = 0.0  # TTFT includes the decode slots it waits for: the prefill queue says
        windows = "1 window" if streak == 1 else f"{streak} windows"
        short = f"{needy} short ({short_why}) for {windows} (patience {self.patience})"
        if streak < self.patience:
            return hold(short)
        if n <= minimum:
            return hold(f"{short}, but {donor} is at its minimum ({n} <= {minimum})")
        if donor_ratio is None:
            return hold(f"{short}, but {donor}'s own latency is unknown: no evidence it can spare a node")
        projected = donor_ratio * n / (n - 1)
        if projected > self.slack:
            return hold(f"{short}, but {donor} cannot spare a node (its SLO ratio would be "
                        f"{projected:.2f}x > slack {self.slack:g})")
        projected_q = donor_q * n / (n - 1)
        if projected_q > max(needy_q, self.idle_queue):
            return hold(f"{short}, but {donor}'s queue would be {projected_q:.1f} per worker, too deep "
                        f"next to {needy}'s {needy_q:.1f}")
        if self.last_move_at is not None:
            reverses = self.last_action == _REVERSE[action]
            wait = self.cooldown_s * (2 if reverses else 1)
            since = f.at - self.last_move_at
            if since < wait:
                what = "reverses the last move" if reverses else "follows the last move"
                return hold(f"{short}; cooldown: this {what} ({self.last_action}) {since:.0f}s ago and "
                            f"needs {wait:g}s")
        return Decision(action, f"{short}, and {donor} can spare a node (its SLO ratio would be "
                                f"{projected:.2f}x <= slack {self.slack:g}); {facts}", f)
