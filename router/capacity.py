"""Decode capacity: which decode workers can still take a request in, so a burst neither overfills one decode
while another idles nor queues prefill work that no decode can receive.

A decode node admits a PD request into preallocation: a request row (`prealloc_slots_free` of them) and KV
pages for its prompt. When it has neither, the request waits in its preallocation queue while its prefill
leg runs and then waits for a destination, so prefill work piles up behind a full decode. `DecodeCapacity`
polls every decode worker's `/get_load` every `--load-check-interval-secs` (each DP group's
`prealloc_slots_free`, `num_prealloc_reqs` and `kv_available_tokens`, summed over groups) and remembers how
many of this router's requests the decode held then (`Worker.active`); the requests it holds beyond those
(a burst since the report, which the report cannot show yet) take rows too, while those that ended give
theirs back. A decode is full when the free rows it reported, less that growth and less the requests already
waiting there for a row, are used up, or when it reported no KV token available. The dispatcher routes among
the decodes that are not full (`usable`) and answers 429 with Retry-After when every decode is full, before
any leg is sent. A decode that reports nothing (an older node, or a failed poll) counts as not full.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import msgspec

log = logging.getLogger("router.capacity")


@dataclass(frozen=True)
class Report:
    prealloc_free: int
    prealloc_waiting: int
    kv_available: int


def parse_report(data) -> Report | None:
    """A decode's `/get_load` answer summed over its DP groups; None when it carries no preallocation
    figures."""
    if not isinstance(data, list) or not data:
        return None
    free = waiting = kv = 0
    for g in data:
        if not isinstance(g, dict):
            return None
        values = (g.get("prealloc_slots_free"), g.get("num_prealloc_reqs", 0), g.get("kv_available_tokens"))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        free, waiting, kv = free + values[0], waiting + values[1], kv + values[2]
    return Report(free, waiting, kv)


class DecodeCapacity:
    def __init__(self, registry, session: aiohttp.ClientSession, interval: float, timeout: float,
                 headers: dict | None = None) -> None:
        self.registry = registry
        self.headers = headers or {}  # the node key: /get_load is not an open route
        self.session = session
        self.interval = interval
        self.timeout = timeout
        self.reports: dict[str, tuple[Report, int]] = {}  # url -> (its last report, its active count then)

    def full(self, w) -> bool:
        seen = self.reports.get(w.url)
        if seen is None:
            return False
        r, active_then = seen
        grown = max(0, w.active - active_then)  # requests sent since the report, less those that ended
        return r.kv_available <= 0 or r.prealloc_free - r.prealloc_waiting - grown <= 0

    def usable(self, workers: list) -> list:
        """The decode workers of `workers` that can take a request (empty: every one is full)."""
        return [w for w in workers if not self.full(w)]

    def observe(self, w, report: Report | None) -> None:
        if report is None:
            self.reports.pop(w.url, None)
        else:
            self.reports[w.url] = (report, w.active)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # one failed round must not end the polling
                log.exception("decode capacity refresh failed")
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        workers = list(self.registry.decode)
        actives = [w.active for w in workers]  # what each held when its report was asked for
        answers = await asyncio.gather(*(self._get(w.url) for w in workers))
        known = {w.url for w in workers}
        for url in [u for u in self.reports if u not in known]:
            del self.reports[url]
        for w, active, report in zip(workers, actives, answers, strict=True):
            if report is None:
                self.reports.pop(w.url, None)
            else:
                self.reports[w.url] = (report, active)

    async def _get(self, url: str) -> Report | None:
        try:
            async with self.session.get(url + "/get_load", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    return None
                return parse_report(msgspec.json.decode(await r.read()))
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
            return None
