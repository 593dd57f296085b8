"""The workload of `pdserve bench chaos` (bench/chaos.py), and of `pdserve bench netfaults`: a closed
loop of clients sending chat, completions and `/generate` requests, streamed or not, through the router,
with client disconnects, explicit aborts and bursts mixed in, each request's end recorded as an
`Outcome`.

`Driver.drive` keeps `--concurrency` requests in flight while the budget lasts, adds a burst of
`--burst-size` requests every `--burst-every` seconds, and calls `on_tick` (the fault plan) and
`progress` between its steps. A request's plan decides its faults: "disconnect" (the client leaves
after k stream events, or after a random delay when not streaming), "abort" (a long `/generate` stream
aborted on every node 0-0.5 s after its first token; timed from its first token, as an abort sent
before the nodes know the rid would be lost) or "burst" (non-streaming, past the router's admission
limits: a 429 is expected).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers watch the cluster heal "
         "itself after every crash and count each page twice before they go home").split()

# a generic message is not a cause: an error must say what failed
VAGUE = re.compile(r"^(internal server error|error|bad gateway|service unavailable|)$", re.I)


@dataclass
class Outcome:
    idx: int
    kind: str  # chat | completions | generate
    stream: bool
    started: float
    plan: str = "normal"  # normal | disconnect | abort | burst
    ended: float | None = None
    result: str = ""  # completed | error | rejected | disconnected | aborted
    status: int = 0
    message: str = ""
    events: int = 0
    events_before_error: int = -1  # stream events the client had when its error came (-1: no error event)


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)  # (time, "kill decode-1")
    open: dict[int, Outcome] = field(default_factory=dict)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 12, 40, 120, 250))))


def normalize(msg: str) -> str:
    """An error message with its numbers, addresses and ids blanked, to count causes."""
    msg = re.sub(r"tcp://[\w.:\[\]-]+|https?://[\w.:\[\]-]+|\d+(\.\d+)?", "#", msg)
    return re.sub(r"\s+", " ", msg)[:160]


def error_text(body) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


class Driver:
    def __init__(self, ns, url: str, node_urls: list[str]) -> None:
        self.ns = ns
        self.url = url
        self.node_urls = node_urls
        self.rng = random.Random(ns.seed)
        self.run = Run()
        self.sent = 0
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ one request
    async def one(self, session, plan: str) -> None:
        ns, rng = self.ns, self.rng
        idx = self.sent
        self.sent += 1
        kind = rng.choice(("chat", "chat", "completions", "generate"))
        if plan == "abort":
            kind = "generate"
        stream = plan != "burst" and (plan == "abort" or rng.random() < ns.stream_prob)
        o = Outcome(idx, kind, stream, time.time(), plan)
        self.run.outcomes.append(o)
        self.run.open[idx] = o
        max_tokens = rng.randint(1, ns.max_tokens)
        if plan == "abort":  # still decoding when its abort comes (0-0.5 s after its first token)
            max_tokens = max(256, ns.max_tokens)
        text = prompt(rng)
        rid = f"chaos-{ns.seed}-{idx}"
        if kind == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                  "max_tokens": max_tokens, "stream": stream,
                                                  "ignore_eos": True}
        elif kind == "completions":
            path, body = "/v1/completions", {"prompt": text, "max_tokens": max_tokens, "stream": stream,
                                             "ignore_eos": True}
        else:
            path, body = "/generate", {"text": text, "rid": rid, "stream": stream,
                                       "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
        stop_after = rng.randint(0, max_tokens) if plan == "disconnect" else None
        on_first = None
        if plan == "abort":  # once its first token is out, so the nodes know the rid when the abort comes
            def on_first():
                later = self.abort_later(session, rid, rng.uniform(0, 0.5))
                abort = asyncio.get_running_loop().create_task(later)
                self.tasks.add(abort)
                abort.add_done_callback(self.tasks.discard)
        try:
            if plan == "disconnect" and not stream:
                try:
                    await asyncio.wait_for(self.send(session, path, body, o, None), rng.uniform(0.01, 1.5))
                except TimeoutError:
                    o.result = "disconnected"
            else:
                await self.send(session, path, body, o, stop_after, on_first)
        except Exception as e:  # the connection broke: an error that names itself
            if not o.result:
                o.result, o.message = "error", f"client: {type(e).__name__}: {e}"
        finally:
            o.ended = time.time()
            if plan == "abort" and o.result in ("error", "completed") and "abort" in o.message.lower():
                o.result = "aborted"
            elif plan == "abort" and o.result == "error":
                o.result = "aborted"  # ended after its abort with an error answer
            self.run.open.pop(idx, None)

    async def send(self, session, path: str, body: dict, o: Outcome, stop_after: int | None,
                   on_first=None) -> None:
        async with session.post(self.url + path, json=body) as resp:
            o.status = resp.status
            if resp.status == 429:
                o.result = "rejected"
                await resp.read()
                return
            if resp.status != 200:
                raw = await resp.read()
                try:
                    o.message = error_text(json.loads(raw))
                except ValueError:
                    o.message = raw.decode(errors="replace")[:300]
                o.result = "error"
                return
            if not o.stream:
                data = await resp.json(content_type=None)
                if isinstance(data, dict) and "error" in data:
                    o.result, o.message = "error", error_text(data)
                else:
                    o.result = "completed"
                return
            done = False
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event, dict) and "error" in event:
                    o.result, o.message = "error", error_text(event)
                    if o.events_before_error < 0:
                        o.events_before_error = o.events
                o.events += 1
                if o.events == 1 and on_first is not None:
                    on_first()
                if self.aborted_finish(event):
                    o.message = o.message or "finished with reason abort"
                if stop_after is not None and o.events >= stop_after:
                    o.result = "disconnected"
                    return  # leaving the `async with` closes the connection
            if not o.result:
                if done and not o.message:
                    o.result = "completed"
                else:
                    o.result = "error"
                    o.message = o.message or "stream ended without [DONE]"

    @staticmethod
    def aborted_finish(event) -> bool:
        if not isinstance(event, dict):
            return False
        reason = (event.get("meta_info") or {}).get("finish_reason")
        if isinstance(reason, dict):
            return reason.get("type") == "abort"
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
                return True
        return False

    async def abort_later(self, session, rid: str, delay: float) -> None:
        await asyncio.sleep(delay)
        for url in self.node_urls:
            try:
                async with session.post(url + "/abort_request", json={"rid": rid}) as r:
                    await r.read()
            except Exception:  # a node being restarted: the abort reaches the others
                pass

    # ------------------------------------------------------------------ the run
    def spawn(self, session, plan: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(self.one(session, plan))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def pick_plan(self) -> str:
        r = self.rng.random()
        if r < self.ns.disconnect_prob:
            return "disconnect"
        if r < self.ns.disconnect_prob + self.ns.abort_prob:
            return "abort"
        return "normal"

    async def drive(self, session, budget_left, progress, on_tick) -> None:
        ns = self.ns
        loop_clients: set[asyncio.Task] = set()
        next_burst = time.time() + ns.burst_every
        while budget_left():
            while len(loop_clients) < ns.concurrency and budget_left():
                t = self.spawn(session, self.pick_plan())
                loop_clients.add(t)
                t.add_done_callback(loop_clients.discard)
            if ns.burst_size and time.time() >= next_burst and budget_left():
                for _ in range(min(ns.burst_size, max(budget_left(), 0))):
                    self.spawn(session, "burst")
                next_burst = time.time() + ns.burst_every
            on_tick()
            progress()
            await asyncio.sleep(0.02)
