"""The router's admission control on the generation routes, with sglang-router's flags:

* `--max-concurrent-requests N` (-1: off): at most N requests in flight; a request holds its place until
  its answer, streamed or not, has ended.
* `--queue-size Q` (100): up to Q more wait in FIFO order for a place; when the queue is full (or Q is 0)
  the answer is 429 with `Retry-After`.
* `--queue-timeout-secs T` (60): a request that waited T seconds in the queue gets 408.
* `--rate-limit-tokens-per-second R` (off): a token bucket in front of the gate; every admitted request
  costs one token, the bucket holds N tokens (R when no N is set) and refills at R per second. A request
  that finds no token waits in the same queue.

The request body is read after admission (a waiting request holds no body), by `read_body`, which
refuses a declared Content-Length over `--max-payload-size` before reading a byte and stops reading a
chunked body as soon as it passes the limit.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time

from aiohttp import web


class Rejected(Exception):
    """An answer instead of admission: `status` (429, 408 or 413), a message naming the limit, and
    `reason` (the metrics label)."""

    def __init__(self, status: int, message: str, reason: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


class TokenBucket:
    """`capacity` tokens, refilled continuously at `rate` per second; starts full."""

    def __init__(self, capacity: float, rate: float, clock=time.monotonic):
        self.capacity = float(capacity)
        self.rate = float(rate)
        self.clock = clock
        self.tokens = self.capacity
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def available(self) -> float:
        self._refill()
        return self.tokens

    def try_take(self) -> bool:
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait(self, n: float = 1.0) -> float:
        """Seconds until `n` tokens are there (0 when they are)."""
        self._refill()
        return max(0.0, (n - self.tokens) / self.rate)


class Admission:
    """Concurrency gate + bounded FIFO queue with a timeout + optional token bucket. `acquire()` returns
    once the request is admitted or raises `Rejected`; every admitted request calls `release()` once."""

    def __init__(self, max_concurrent: int = -1, queue_size: int = 100, queue_timeout: float = 60.0,
                 rate: float | None = None):
        self.max_concurrent = max_concurrent if max_concurrent > 0 else 0  # 0: no concurrency limit
        self.queue_size = max(0, queue_size)
        self.queue_timeout = queue_timeout
        self.bucket = None
        if rate is not None and rate > 0:
            self.bucket = TokenBucket(self.max_concurrent or max(1.0, rate), rate)
        self.enabled = bool(self.max_concurrent or self.bucket)
        self.in_flight = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.rejected: collections.Counter = collections.Counter()  # reason -> count
        self.admitted = 0
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------------------ state

    @property
    def queued(self) -> int:
        return len(self.waiters)

    def _slot_free(self) -> bool:
        return not self.max_concurrent or self.in_flight < self.max_concurrent

    def _admit(self) -> None:
        self.in_flight += 1
        self.admitted += 1

    def describe(self) -> dict:
        return {"in_flight": self.in_flight, "queued": self.queued, "admitted": self.admitted,
                "rejected": dict(self.rejected), "max_concurrent_requests": self.max_concurrent or -1,
                "queue_size": self.queue_size, "queue_timeout_secs": self.queue_timeout,
                "rate_limit_tokens_per_second": self.bucket.rate if self.bucket else None,
                "rate_limit_tokens_available": round(self.bucket.available(), 3) if self.bucket else None}

    # ------------------------------------------------------------------------------ admission

    def _retry_after(self) -> int:
        """A hint for a refused client: when a token for everyone queued (and it) should be there, else 1
        s."""
        if self.bucket is not None:
            return max(1, math.ceil(self.bucket.wait(self.queued + 1.0)))
        return 1

    def _reject_full(self) -> Rejected:
        after = self._retry_after()
        if not self._slot_free():
            reason = "queue_full" if self.queue_size else "concurrency"
            what = f"{self.in_flight} requests in flight (--max-concurrent-requests {self.max_concurrent})"
        else:
            reason = "queue_full" if self.queue_size else "rate_limit"
            what = f"the request rate limit (--rate-limit-tokens-per-second {self.bucket.rate:g}) is reached"
        if self.queue_size:
            what += f" and {self.queued} waiting (--queue-size {self.queue_size})"
        self.rejected[reason] += 1
        return Rejected(429, f"router overloaded: {what}; retry after {after} s", reason, after)

    async def acquire(self) -> None:
        if not self.enabled:
            self._admit()
            return
        if not self.waiters and self._slot_free() and (self.bucket is None or self.bucket.try_take()):
            self._admit()
            return
        if len(self.waiters) >= self.queue_size:
            raise self._reject_full()
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self._pump()  # a slot may be free and only a token missing: arm the refill timer
        try:
            async with asyncio.timeout(self.queue_timeout):
                await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # admitted at the deadline
            self._drop(fut)
            self.rejected["queue_timeout"] += 1
            raise Rejected(408, f"request waited {self.queue_timeout:g} s in the router's queue without "
                                f"being admitted (--queue-timeout-secs {self.queue_timeout:g}, "
                                f"--max-concurrent-requests {self.max_concurrent or -1})", "queue_timeout",
                           self._retry_after()) from None
        except asyncio.CancelledError:  # the client went away while waiting
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                self._drop(fut)
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._pump()

    def _drop(self, fut: asyncio.Future) -> None:
        fut.cancel()
        try:
            self.waiters.remove(fut)
        except ValueError:
            pass
        self._pump()  # a waiter behind it may be admissible now

    def _pump(self) -> None:
        """Admit waiters from the head of the queue while a slot and a token are there."""
        waiters = self.waiters
        while waiters:
            if waiters[0].done():  # cancelled: its task is on its way out
                waiters.popleft()
                continue
            if not self._slot_free():
                return
            if self.bucket is not None and not self.bucket.try_take():
                self._arm(self.bucket.wait())
                return
            self._admit()
            waiters.popleft().set_result(None)

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            return

        def fire() -> None:
            self._timer = None
            self._pump()

        self._timer = asyncio.get_running_loop().call_later(max(delay, 0.001), fire)


def check_length(request: web.Request, limit: int) -> None:
    """413 for a declared Content-Length over `limit`, before a byte of the body is read."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Rejected(413, f"request body of {declared} bytes is over the router's limit of {limit} bytes "
                            "(--max-payload-size)", "payload_too_large")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 when its declared length is over `limit` (nothing read) or as
    soon as the bytes read pass it (chunked or undeclared bodies)."""
    check_length(request, limit)
    parts = []
    size = 0
    content = request.content
    while True:
        chunk = await content.readany()
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise Rejected(413, f"request body is over the router's limit of {limit} bytes "
                                f"(--max-payload-size); stopped reading after {size} bytes",
                           "payload_too_large")
        parts.append(chunk)
