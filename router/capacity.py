"""Decode capacity: which decode workers can still take a request in, so a burst neither overfills one decode
while another idles nor queues prefill work that no decode can receive.

A decode node admits a PD request into preallocation: a request row (`prealloc_slots_free` of them) and KV
pages for its prompt. When it has neither, the request waits in its preallocation queue while its prefill
leg runs and then waits for a destination, so prefill work piles up behind a full decode. `DecodeCapacity`
polls every decode worker's `/get_load` every `--load-check-interval-secs` (each DP group's
`prealloc_slots_free`, `num_prealloc_reqs` and `kv_available_tokens`, summed over groups) and counts the
requests this router has sent each one since its last report (`routed`), which the report cannot show yet.
A decode is full when the free rows it reported, less those requests and less the requests already waiting
there for a row, are used up, or when it reported no KV token available. The dispatcher routes among the
decodes that are not full (`usable`) and answers 429 with Retry-After when every decode is full, before
any leg is sent. A decode that reports nothing (an older node, or a failed poll) counts as not full.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
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
    """A decode's `/get_load` answer summed over its DP groups; None when it carries no preallocation figures."""
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
        self.reports: dict[str, Report] = {}
        self.pending: Counter[str] = Counter()  # requests routed to a decode since its last report

    def routed(self, w) -> None:
        self.pending[w.url] += 1

    def full(self, w) -> bool:
        r = self.reports.get(w.url)
        if r is None:
            return False
        return r.kv_available <= 0 or r.prealloc_free - r.prealloc_waiting - self.pending[w.url] <= 0

    def usable(self, workers: list) -> list:
        """The decode workers of `workers` that can take a request (empty: every one is full)."""
        return [w for w in workers if not self.full(w)]

    def observe(self, url: str, report: Report | None) -> None:
        if report is None:
            self.reports.pop(url, None)
        else:
            self.reports[url] = report
        self.pending.pop(url, None)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # one failed round must not end the polling
                log.exception("decode capacity refresh failed")
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        workers = list(self.registry.decode)
        answers = await asyncio.gather(*(self._get(w.url) for w in workers))
        known = {w.url for w in workers}
        for url in [u for u in self.reports if u not in known]:
            self.observe(url, None)
        for w, report in zip(workers, answers, strict=True):
            self.observe(w.url, report)

    async def _get(self, url: str) -> Report | None:
        try:
            async with self.session.get(url + "/get_load", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    return None
                return parse_report(msgspec.json.decode(await r.read()))
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
            return None
