"""One request's state in the front end, from `submit` to `release`.

A `ReqState` is made per prompt of an HTTP call (`ReqState.create`); all the states of one call share
one `asyncio.Event` (`notify`), set whenever any of them changes, so a handler waits on one event
for a whole batch. What the scheduler reports for the request (`BatchOut` updates) is folded in by
`absorb` (token ids, counters, logprobs, and the token timing metrics); its text grows in its
`IncrementalDetokenizer`. `finish` ends it once, whatever ended it (the scheduler's finish reason,
an abort, --request-timeout, a dead scheduler). `count_release` adds the ended request to the
node's request metrics.

The front end's bookkeeping around a state (which rids are waiting for admission, the DP group
counts, the ZMQ messages) stays with `TokenizerManager`; a state only holds what the handlers read.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from common.protocol import SamplingParams, TokenizedRequest
from common.server.detokenizer import IncrementalDetokenizer
from common.server.metrics import Metrics


@dataclass
class ReqState:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    notify: asyncio.Event
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    endpoint: str = "generate"
    created: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    error_status: int = 0
    finished: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    released: bool = False
    deadline: asyncio.TimerHandle | None = None  # --request-timeout
    admitted: bool = False  # the scheduler took it in (its queue had room)
    detok_busy: bool = False  # a long update is being detokenized on the pool
    span: Any = None  # its span (--enable-trace), ended on release
    dp_rank: int = 0  # the DP group running it

    @classmethod
    def create(cls, r: TokenizedRequest, tokenizer, special_ids, notify: asyncio.Event, *, endpoint: str,
               return_text_in_logprobs: bool, created: float, dp_rank: int) -> ReqState:
        """The state of a request about to be sent, with a detokenizer set up from its sampling parameters."""
        sp = r.sampling
        detok = IncrementalDetokenizer(
            tokenizer, r.input_ids, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            stop_strings=sp.stop_strings(), no_stop_trim=sp.no_stop_trim, special_ids=special_ids)
        return cls(rid=r.rid, input_ids=r.input_ids, sampling=sp, detok=detok, notify=notify,
                   stream=r.stream, return_logprob=r.return_logprob, top_logprobs_num=r.top_logprobs_num,
                   return_text_in_logprobs=return_text_in_logprobs, endpoint=endpoint, created=created,
                   prompt_tokens=len(r.input_ids), dp_rank=dp_rank)

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def e2e_latency(self) -> float:
        return (self.finished_time or time.time()) - self.created

    def absorb(self, u, metrics: Metrics) -> list[int]:
        """Fold in one scheduler update (everything but its text); returns its new token ids. The first
        tokens give the time to first token; later ones share the gap since the previous update as their
        inter-token latency (several tokens of the first update count as no gap)."""
        now = time.time()
        new = list(u.new_token_ids)
        if new:
            if self.first_token_time is None:
                self.first_token_time = now
                metrics.ttft.observe(now - self.created)
                for _ in range(len(new) - 1):
                    metrics.itl.observe(0.0)
            else:
                gap = (now - (self.last_token_time or now)) / len(new)
                for _ in new:
                    metrics.itl.observe(gap)
            self.last_token_time = now
            self.output_ids.extend(new)
        self.prompt_tokens = u.prompt_tokens or self.prompt_tokens
        self.completion_tokens = u.completion_tokens
        self.cached_tokens = u.cached_tokens
        if u.output_logprobs:
            self.output_logprobs.extend(tuple(x) for x in u.output_logprobs)
        if u.output_top_logprobs:
            self.output_top_logprobs.extend([tuple(y) for y in x] for x in u.output_top_logprobs)
        if u.input_logprobs:
            self.input_logprobs.extend(tuple(x) for x in u.input_logprobs)
        if u.input_top_logprobs:
            self.input_top_logprobs.extend(None if x is None else [tuple(y) for y in x]
                                           for x in u.input_top_logprobs)
        return new

    def finish(self, reason: dict[str, Any], error_status: int = 0, new_ids: list[int] | None = None) -> None:
        """End the request: the detokenizer's last step (unless the pool is doing it), the finish reason,
        token counts the scheduler never reported, and a wake-up for the handler."""
        if not self.detok_busy:  # else the pool's step is the last one
            self.detok.step(new_ids or [], reason)
        self.finish_reason = reason
        self.error_status = error_status
        self.finished = True
        self.finished_time = time.time()
        if not self.completion_tokens:
            self.completion_tokens = len(self.output_ids)
        if not self.prompt_tokens:
            self.prompt_tokens = len(self.input_ids)
        self.notify.set()

    def count_release(self, metrics: Metrics, status: int) -> None:
        """The request's share of the node's metrics once the HTTP side answered it with `status`: its
        tokens, and for a request that was not aborted and succeeded, its latency and time per output
        token."""
        metrics.requests.inc(endpoint=self.endpoint, status=str(status))
        metrics.prompt_tokens.inc(self.prompt_tokens)
        metrics.generation_tokens.inc(self.completion_tokens)
        metrics.cached_tokens.inc(self.cached_tokens)
        if self.finish_reason and self.finish_reason.get("type") == "abort":
            metrics.aborted.inc()
        elif status < 400:
            metrics.e2e.observe(self.e2e_latency)
            if self.first_token_time is not None and self.completion_tokens > 1:
                decode_time = (self.finished_time or time.time()) - self.first_token_time
                metrics.tpot.observe(decode_time / (self.completion_tokens - 1))
