"""Why an attempt failed, and what happens next: the retry table, and what a worker's answer means for its
circuit breaker.

An attempt that ends before the client got a byte ends in a `Failure`: its `kind` (who failed, and how) and
its HTTP status. `RETRY_TABLE` maps (kind, status) to a budget, and `Retries.allows` is the one function that
reads it (`Retries.again` logs the failure and waits the backoff). The budgets: `NONE`, the failure is the
client's answer; `ONCE`, one more try per request, and only
while another worker of the kind that failed is available (an overloaded node: trying every worker in turn is
the retry storm that turns an overloaded cluster into a dead one); `ATTEMPTS`, up to --retry-max-retries
attempts in all, each after a backoff and on another pair where there is one (a broken worker or link). A
(kind, status) the table does not name (a worker's 400 or 404, ...) is answered as it is. A failure naming
`ROLE_SWITCH` (a node that is switching its role handed the request back before it started) gets
`ATTEMPTS` whatever its status.

After the first token nothing is retried: the client has bytes, so a failure is an SSE error event that
ends its stream (router/relay.py).

For the circuit breaker a worker's answer is a success below 500 and a failure from 500 on, except the
answers that say "busy" or "too late" (408, 429, 503, 504) and a failed KV transfer the node names
(`ERR_TYPE_HEADER`): the transfer may be either node's doing, and the node at fault fails its own leg; a
role switch's hand-back is no failure either.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from dataclasses import dataclass

import msgspec
from aiohttp import web

from common.protocol import KV_TRANSFER_FAILED, ROLE_SWITCH, error_body
from router.registry import Worker

log = logging.getLogger("router.dispatch")  # the request's walk, as its other lines


class Kind(enum.Enum):
    ANSWER = "the worker answered with an error status"
    BROKEN = "the leg's connection failed, broke or timed out"
    LEAD_ERROR = "the decode stream's first event with a token is an error"
    NO_WORKERS = "no worker of a kind is available"
    DECODES_FULL = "every decode worker is full"
    BAD_REQUEST = "the request does not fit the decode worker picked"


class Budget(enum.Enum):
    NONE = "answered as it is"
    ONCE = "one more try per request, on another worker"
    ATTEMPTS = "up to --retry-max-retries attempts"


RETRY_TABLE: dict[tuple[Kind, int], Budget] = {
    (Kind.ANSWER, 429): Budget.NONE,          # the node's queue is full: its Retry-After goes to the client
    (Kind.ANSWER, 408): Budget.ONCE,          # a node that timed the request out in its queue
    (Kind.ANSWER, 503): Budget.ONCE,          # an overloaded node
    (Kind.ANSWER, 504): Budget.NONE,          # the worker's own deadline passed: it would pass elsewhere too
    (Kind.ANSWER, 500): Budget.ATTEMPTS,      # a broken worker
    (Kind.ANSWER, 502): Budget.ATTEMPTS,      # a broken worker, or one that refused the router's node key
    (Kind.BROKEN, 502): Budget.ATTEMPTS,      # the connection failed or broke
    (Kind.BROKEN, 504): Budget.ATTEMPTS,      # no answer within --request-timeout-secs
    (Kind.LEAD_ERROR, 500): Budget.ATTEMPTS,  # the decode failed before its first token (a KV transfer, say)
    (Kind.LEAD_ERROR, 502): Budget.ATTEMPTS,
    (Kind.LEAD_ERROR, 503): Budget.ONCE,      # as a 503 answer
    # none available of a kind (unhealthy, circuit open): wait a little
    (Kind.NO_WORKERS, 503): Budget.ATTEMPTS,
    (Kind.DECODES_FULL, 429): Budget.NONE,    # every decode is full: the client comes back after Retry-After
    (Kind.BAD_REQUEST, 400): Budget.NONE,     # a data_parallel_rank the decode does not have
}
# a node switching its role hands back what it had not started (503 or a lead error naming ROLE_SWITCH):
# the request runs again on another pair, within the attempts, and the node's breaker hears nothing
ROLE_SWITCH_BUDGET = Budget.ATTEMPTS
OVERLOAD = frozenset({408, 429, 503})  # "busy": passed on without a warning in the log
_BREAKER_NEUTRAL = OVERLOAD | {504}
# a decode stream's lead error of these types is the node's failure, not the request's: run it again
LEAD_ERROR_STATUS = {"internal_error": 500, "upstream_error": 502, "service_unavailable": 503}


def header_value(value: str) -> bytes:
    return value.replace("\r", " ").replace("\n", " ").encode("latin-1", "replace")


def error_response(status: int, message: str, headers=None, code: str | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(error_body(status, message, code)), status=status,
                        content_type="application/json", headers=headers)


@dataclass(slots=True)
class Failure:
    """Why an attempt ended before the client got a byte."""

    kind: Kind
    status: int
    message: str
    worker: Worker | None = None
    body: bytes | None = None  # the worker's own answer, passed on as it is
    content_type: str | None = None
    retry_after: str | None = None  # the worker's Retry-After header
    err_type: str | None = None  # the cause the worker named (`ERR_TYPE_HEADER`)

    @classmethod
    def answer(cls, status: int, leg: str, w: Worker, body: bytes, ctype: str | None,
               retry_after: str | None = None, err_type: str | None = None) -> Failure:
        """A worker's error answer, passed on as it is, except a refusal of the router's own credentials: the
        client's key was fine, so it gets a 502 that says what to fix, not the worker's 401."""
        if status in (401, 403):
            log.error("%s worker %s refused the router's credentials (%d): check the node key",
                      leg, w.url, status)
            return cls(Kind.ANSWER, 502, f"{leg} worker {w.url} refused the router's credentials ({status}); "
                       "the router's node key (--node-api-key-file / PDSERVE_NODE_API_KEY) does not match "
                       "the worker's", w)
        return cls(Kind.ANSWER, status, f"{leg} worker {w.url} answered {status}", w,
                   body, ctype, retry_after, err_type)

    @classmethod
    def broken(cls, exc: BaseException, leg: str, w: Worker) -> Failure:
        status = 504 if isinstance(exc, TimeoutError) else 502
        return cls(Kind.BROKEN, status, f"{leg} worker {w.url} failed: {exc!r}", w)

    @classmethod
    def lead_error(cls, error: dict, w: Worker) -> Failure | None:
        """The Failure a decode stream's lead error event means, None when it is the request's own error
        (a refused request: relayed to the client as it is)."""
        status = LEAD_ERROR_STATUS.get(error.get("type"))
        if status is None:
            return None
        err_type = error.get("code") if error.get("code") in (KV_TRANSFER_FAILED, ROLE_SWITCH) else None
        return cls(Kind.LEAD_ERROR, status, f"decode worker {w.url} failed the request before its first "
                                            f"token: {str(error.get('message'))[:300]}", w, err_type=err_type)

    def response(self, request_id: str) -> web.Response:
        headers = {"X-Request-ID": request_id}
        if self.retry_after is not None:
            headers["Retry-After"] = header_value(self.retry_after).decode("latin-1")
        elif self.status == 429:
            headers["Retry-After"] = "1"
        if self.body is not None:  # the worker's own answer, status and body preserved
            return web.Response(body=self.body, status=self.status, headers=headers,
                                content_type=(self.content_type or "application/json").split(";")[0])
        return error_response(self.status, self.message, headers=headers)


class Retries:
    """One request's retries: `allows` is the one reader of `RETRY_TABLE`; `again` logs each failure and
    waits the backoff before the next attempt. The `once` budget's extra try is spent once per request."""

    def __init__(self, cfg, metrics, other_available, request_id: str) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.other_available = other_available  # worker -> whether another of its kind can take a request
        self.request_id = request_id
        self.once_spent = False

    def allows(self, failure: Failure, attempt: int) -> bool:
        """Whether attempt `attempt` (0 for the first), which ended in `failure`, is followed by another."""
        budget = ROLE_SWITCH_BUDGET if failure.err_type == ROLE_SWITCH \
            else RETRY_TABLE.get((failure.kind, failure.status), Budget.NONE)
        if budget is Budget.ONCE:
            allowed = not self.once_spent and failure.worker is not None \
                and self.other_available(failure.worker)
            self.once_spent = True
        else:
            allowed = budget is Budget.ATTEMPTS
        return allowed and attempt + 1 < self.cfg.max_attempts

    async def again(self, failure: Failure, attempt: int) -> bool:
        """`allows`, after logging a worker's failure (an overload answer that ends the request quietly), and
        once the backoff before the next attempt has passed."""
        allowed = self.allows(failure, attempt)
        if failure.worker is not None:
            if allowed:
                log.warning("request %s attempt %d failed, retrying: %s", self.request_id, attempt + 1,
                            failure.message)
            elif failure.status not in OVERLOAD:
                log.warning("request %s attempt %d failed: %s", self.request_id, attempt + 1, failure.message)
        if allowed:
            self.metrics.retries += 1
            await asyncio.sleep(self.backoff(attempt + 1))
        return allowed

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (1 for the first retry): exponential, capped, jittered."""
        c = self.cfg
        ms = min(c.retry_initial_backoff_ms * c.retry_backoff_multiplier ** (attempt - 1),
                 c.retry_max_backoff_ms)
        return max(0.0, ms * (1 + random.uniform(-c.retry_jitter_factor, c.retry_jitter_factor)) / 1000)


def count_answer(w: Worker, status: int, err_type: str | None = None) -> None:
    """A worker's answer, for its circuit breaker (see the module's docstring)."""
    if status in _BREAKER_NEUTRAL or err_type in (KV_TRANSFER_FAILED, ROLE_SWITCH):
        return
    ok = status < 500
    w.breaker.record(ok)
    if not ok:
        w.errors += 1


def count_broken(w: Worker) -> None:
    """A leg whose connection failed or broke: a failure for the worker's circuit breaker."""
    w.errors += 1
    w.breaker.record(False)
