"""Silent workers: a worker that stops answering is out of rotation within `--worker-silence-timeout-secs`.

The health checks (`--health-check-interval-secs` x `--health-failure-threshold`, sglang-router's 60 s x 3 by
default) take minutes to notice a host whose link was cut, and until then a non-streaming leg waits on it
with nothing to bound it (a stream at least has the node's keep-alives). `SilenceWatch` bounds both: every
worker is pinged on its health endpoint every quarter of the window (each ping bounded by the same quarter);
a worker that has not answered anything for the whole window is declared silent: it leaves rotation, and its
connections are cut (`Legs.cut_off` in router/legs.py), so the requests it holds fail at once and run again
on another pair when nothing of them reached the client yet (router/relay.py), or end with a clear error
when something had. Any answer counts as a sign of life (a 503 of a node that is up but unhealthy is the
health checks' business, not this watch's); a worker this watch declared silent is taken back into rotation
by it as soon as it answers 200 again. One log line per change, with the worker and how long it was silent.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

log = logging.getLogger("router.liveness")


class SilenceWatch:
    def __init__(self, registry, session: aiohttp.ClientSession, window: float, endpoint: str = "/health",
                 on_silent=None, metrics=None) -> None:
        self.registry = registry
        self.session = session
        self.window = window
        self.endpoint = endpoint
        self.on_silent = on_silent  # called with the worker once it is declared silent
        self.metrics = metrics
        self.heard: dict[str, float] = {}  # worker url -> when it last answered anything
        self.silenced: set[str] = set()  # workers this watch took out of rotation

    @property
    def period(self) -> float:
        return self.window / 4

    async def run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # a round that raised must not end the watch
                log.exception("silence watch round failed")
            await asyncio.sleep(self.period)

    async def check_once(self) -> None:
        workers = self.registry.all()
        answers = await asyncio.gather(*(self._ping(w.url) for w in workers))
        now = time.monotonic()
        for url in [u for u in self.heard if u not in {w.url for w in workers}]:
            self.heard.pop(url, None)
            self.silenced.discard(url)
        for w, status in zip(workers, answers, strict=True):
            self.observe(w, status, now)

    def observe(self, w, status: int | None, now: float) -> None:
        """One ping's outcome for worker `w` (`status` None: no answer within the period)."""
        last = self.heard.setdefault(w.url, now)
        if status is not None:
            self.heard[w.url] = now
            if w.url in self.silenced and status == 200:
                self.silenced.discard(w.url)
                w.healthy = True
                log.info("worker %s answers again after %.1fs: back in rotation", w.url, now - last)
            return
        silent = now - last
        if silent >= self.window and w.url not in self.silenced:
            self.silenced.add(w.url)
            w.healthy = False
            if self.metrics is not None:
                self.metrics.silent_workers += 1
            log.warning("worker %s silent for %.1fs (--worker-silence-timeout-secs %g): out of rotation, its "
                        "requests cut off", w.url, silent, self.window)
            if self.on_silent is not None:
                self.on_silent(w)

    async def _ping(self, url: str) -> int | None:
        try:
            async with self.session.get(url + self.endpoint,
                                        timeout=aiohttp.ClientTimeout(total=self.period)) as r:
                await r.read()
                return r.status
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
