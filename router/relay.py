"""One attempt of a request on a prefill and a decode worker, relayed to the client as one state machine.

Both legs are sent at once (the decode node waits for the KV the prefill node sends it). The client hears
only the decode leg; the prefill leg matters until the decode's first token (by then the KV has arrived)
and, with logprobs asked for, for the prompt's logprobs it answers. An attempt is in one `State`:

    WAITING_FIRST_TOKEN --LEAD--> STREAMING --EVENT--> STREAMING
          |  |  |                   |  |  `--END--> DONE
          |  |  `--ANSWERED--> DONE |  `--BROKE--> FAILED_FINAL
          |  `--FAILED--> FAILED_RETRYABLE
          `--HUNG_UP--> CLIENT_GONE <--HUNG_UP--'

* WAITING_FIRST_TOKEN: nothing has reached the client. A stream's keep-alives and a chat stream's role
  chunk are held back (the state stays), so any failure leaves the client with nothing and can run again:
  a leg's error answer, a broken or silent connection, a decode stream whose lead (its first event
  with a token) is an error event of the node's own (a failed KV transfer, say; router/retry.py tells it
  from the request's own error, which is relayed). FAILED ends the attempt in FAILED_RETRYABLE with a
  `Failure` that the retry table judges. A whole (not streamed) answer ends it in DONE (ANSWERED).
* STREAMING: the client has the status and the events so far; each event is relayed as it comes (EVENT),
  through the logprobs merge when asked for. The prefill leg's ending no longer matters here, a failure
  included: its node may die once the KV is sent. [DONE] or the decode stream's end is DONE; a decode leg
  that breaks or says nothing for --stream-idle-timeout-secs is FAILED_FINAL: an SSE error event and
  [DONE] end the client's stream, and nothing is retried.
* CLIENT_GONE: the client went away; both legs are aborted on their nodes.

`TRANSITIONS` is every move the machine makes; `Attempt.advance` refuses any other. What each end leaves
to do (which leg to abort on its node, what to count) is in `Attempt._fail` for FAILED_RETRYABLE and in
`Attempt._settle` for the others.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

import msgspec
from aiohttp import web

from common.protocol import error_body
from router.legs import LEG_ERRORS, LegAnswer, Legs, failure_of
from router.logprobs import PrefillPrompt, StreamMerger, merged_body
from router.metrics import Metrics
from router.registry import Worker
from router.request import ParsedRequest
from router.retry import Failure, count_answer, count_broken
from router.sse import Event, Kind, Splitter

log = logging.getLogger("router.relay")
_DONE = b"data: [DONE]\n\n"


class State(enum.Enum):
    WAITING_FIRST_TOKEN = "nothing has reached the client"
    STREAMING = "the client has the status and the events so far"
    DONE = "the client has the whole answer"
    FAILED_RETRYABLE = "ended before the client got a byte"
    FAILED_FINAL = "the decode leg broke mid-stream"
    CLIENT_GONE = "the client went away"


class Signal(enum.Enum):
    FAILED = "a leg failed, or the decode stream's lead is the node's error"
    LEAD = "the decode stream's first event with a token (or its end without one)"
    ANSWERED = "the decode's whole answer"
    EVENT = "an event relayed"
    END = "[DONE], or the end of the decode stream"
    BROKE = "the decode leg broke or went silent mid-stream"
    HUNG_UP = "the client went away"


_W, _S = State.WAITING_FIRST_TOKEN, State.STREAMING
TRANSITIONS: dict[tuple[State, Signal], State] = {
    (_W, Signal.FAILED): State.FAILED_RETRYABLE,
    (_W, Signal.LEAD): _S,
    (_W, Signal.ANSWERED): State.DONE,
    (_W, Signal.HUNG_UP): State.CLIENT_GONE,
    (_S, Signal.EVENT): _S,
    (_S, Signal.END): State.DONE,
    (_S, Signal.BROKE): State.FAILED_FINAL,
    (_S, Signal.HUNG_UP): State.CLIENT_GONE,
}
_HELD_BACK = (Kind.COMMENT, Kind.PREAMBLE)


class Attempt:
    """One try of `req` on prefill worker `p` (None: decode worker `d` prefills it itself) and `d`, with the
    legs' bodies `payloads`: `run` answers the client, or returns the Failure that ended the attempt before
    the client got a byte."""

    def __init__(self, legs: Legs, metrics: Metrics, req: ParsedRequest, p: Worker | None, d: Worker,
                 payloads: tuple[bytes, bytes], headers: bytes, rids: list[str], request_id: str, trace,
                 local=None) -> None:
        self.legs, self.metrics, self.req, self.p, self.d = legs, metrics, req, p, d
        self.payloads, self.headers, self.rids = payloads, headers, rids
        self.request_id, self.trace = request_id, trace
        self.local = local  # a LocalPrefill, done once the decode's lead is in
        self.state = State.WAITING_FIRST_TOKEN
        self.prefill: asyncio.Future | None = None  # the prefill leg's task
        self.decode: asyncio.Future | None = None  # the decode leg's task
        self.resp = None  # the decode stream's response, once it answered
        self.splitter = Splitter()
        self.pending: list[Event] = []  # events of the decode stream read but not relayed yet
        self.lead: Event | None = None  # the first of them that carries a token or an error
        self.merger: StreamMerger | None = None  # with logprobs asked for
        self.decode_failed = False  # the decode stream carried an error event
        self.stream_answered = False  # the decode answered 2xx and its lead was read
        self.broke = ""  # why the decode leg broke mid-stream

    def advance(self, signal: Signal) -> State:
        try:
            self.state = TRANSITIONS[self.state, signal]
        except KeyError:
            raise RuntimeError(f"attempt in state {self.state.name} got {signal.name}") from None
        return self.state

    async def run(self, request: web.Request) -> web.StreamResponse | Failure:
        self.prefill = self.legs.send(self.p, self.req.path, self.payloads[0], self.headers)
        try:
            if self.req.stream:
                return await self._stream(request)
            return await self._whole()
        except asyncio.CancelledError:  # the client went away (aiohttp cancels its handler)
            if self.state in (_W, _S):
                self.advance(Signal.HUNG_UP)
                self._settle()
            raise

    # ------------------------------------------------------------------ the ends

    def _fail(self, failure: Failure) -> Failure:
        """FAILED_RETRYABLE: the leg that did not fail is abandoned (aborted on its node)."""
        self.advance(Signal.FAILED)
        if failure.worker is self.d:
            self.legs.abandon(self.prefill, self.p, self.rids)
        else:  # a stream's decode leg may have its lead in, its request still running on its node
            self.legs.abandon(self.decode, self.d, self.rids, force=self.req.stream)
        return failure

    def _settle(self) -> None:
        """What the end of a relayed attempt leaves to do: the legs still running stopped, and counted."""
        legs, state = self.legs, self.state
        if state is State.DONE:
            if self.decode_failed:  # its decode will not take the KV: the prefill leg must not wait for it
                legs.abandon(self.prefill, self.p, self.rids)
        elif state is State.FAILED_FINAL:
            self.metrics.stream_errors += 1
            legs.abandon(self.prefill, self.p, self.rids)
            legs.abort(self.d, self.rids)
        elif state is State.CLIENT_GONE:
            self.metrics.client_disconnects += 1
            legs.abandon(self.prefill, self.p, self.rids)
            legs.abandon(self.decode, self.d, self.rids, force=self.req.stream)

    # ------------------------------------------------------------------ a whole answer

    async def _whole(self) -> web.Response | Failure:
        self.decode = self.legs.send(self.d, self.req.path, self.payloads[1], self.headers)
        done, _ = await asyncio.wait((self.prefill, self.decode), return_when=asyncio.FIRST_COMPLETED)
        failure = failure_of(self.prefill, self.p, "prefill") if self.prefill in done else None
        if failure is None:
            await asyncio.wait((self.decode,))
            failure = failure_of(self.decode, self.d, "decode")
        if failure is not None:
            return self._fail(failure)
        answer = self.decode.result()
        body = answer.body
        if self.req.return_logprob:  # the prompt's logprobs are the prefill leg's
            await asyncio.wait((self.prefill,))
            if self.prefill.exception() is None and self.prefill.result().status < 300:
                try:
                    body = merged_body(self.prefill.result().body, body)
                except msgspec.DecodeError:
                    log.warning("request %s: logprobs not merged (a leg's body is not JSON)", self.request_id)
        self.advance(Signal.ANSWERED)
        return web.Response(body=body, status=answer.status, headers={"X-Request-ID": self.request_id},
                            content_type=(answer.content_type or "application/json").split(";")[0])

    # ------------------------------------------------------------------ a stream

    async def _stream(self, request: web.Request) -> web.StreamResponse | Failure:
        d = self.d
        d.active += 1
        d.requests += 1
        self.decode = self.legs.hold(asyncio.get_running_loop().create_task(self._read_lead()))
        try:
            failure = await self._wait_first_token()
            if failure is not None:
                return self._fail(failure)
            out = web.StreamResponse(status=self.resp.status, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Request-ID": self.request_id})
            await out.prepare(request)
            self.trace.first_byte = time.perf_counter()
            self.advance(Signal.LEAD)
            await self._relay(out)
            self._settle()
            if self.state is State.FAILED_FINAL:  # the client's stream ends with an error event
                try:
                    await out.write(b"data: "
                                    + msgspec.json.encode(error_body(502, self.broke)) + b"\n\n" + _DONE)
                except ConnectionError:
                    pass
            return out
        finally:
            d.active -= 1
            if self.resp is not None and self.state is not State.DONE:
                self.resp.close()
            if self.stream_answered:  # the decode's breaker hears how its stream ended
                d.breaker.record(self.state is not State.FAILED_FINAL)

    async def _read_lead(self) -> LegAnswer | None:
        """The decode leg up to its lead: its response, then its events, held back until one carries a token
        or an error (`lead`); the events read stay in `pending`. Its whole answer instead when it answered
        an error status. Each read is bounded by --stream-idle-timeout-secs."""
        legs = self.legs
        self.resp = resp = await legs.open_stream(self.d, self.req.path, self.payloads[1], self.headers)
        try:
            if resp.status >= 300:
                return LegAnswer.of(resp, await resp.read())
            while data := await legs.read(resp):
                events = self.splitter.feed(data)
                self.pending += events
                for event in events:
                    if event.kind not in _HELD_BACK:
                        self.lead = event
                        return None
            # the stream ended without a lead: relay what it sent, unless that was only keep-alives
            if all(e.kind is Kind.COMMENT for e in self.pending) and \
                    all(not line or line.startswith(b":") for line in self.splitter.rest.split(b"\n")):
                self.pending, self.splitter.rest = [], b""
            return None
        except BaseException:
            resp.close()
            raise

    async def _wait_first_token(self) -> Failure | None:
        """WAITING_FIRST_TOKEN: both legs run, and the first failure of either ends the attempt. None once the
        decode's lead is in, and with logprobs asked for the prefill leg's answer too."""
        pending = {self.prefill, self.decode}
        while self.decode in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if self.prefill in done and (failure := failure_of(self.prefill, self.p, "prefill")):
                return failure
        if self.local is not None:  # its prefill is over: the decode worker may take the next one
            self.local.done()
        d, exc = self.d, self.decode.exception()
        if exc is not None:
            count_broken(d)
            self.legs.abort(d, self.rids)
            return Failure.broken(exc, "decode", d)
        answer = self.decode.result()
        if answer is not None:  # the decode answered an error status
            count_answer(d, answer.status, answer.err_type)
            return failure_of(self.decode, d, "decode")
        if self.lead is not None and self.lead.kind is Kind.ERROR:
            failure = Failure.lead_error(self.lead.error, d)
            if failure is not None:  # the node failed the request before its first token: run it again
                count_answer(d, failure.status, failure.err_type)  # its breaker hears this, not a success
                self.metrics.reruns_before_first_token += 1
                return failure
        self.stream_answered = True
        if self.req.return_logprob:  # the prompt's logprobs are the prefill leg's: wait for its answer
            await asyncio.wait((self.prefill,))
            if failure := failure_of(self.prefill, self.p, "prefill"):
                return failure
            try:
                self.merger = StreamMerger(PrefillPrompt.of(self.prefill.result().body))
            except msgspec.DecodeError:
                self.merger = None
        return None

    async def _relay(self, out: web.StreamResponse) -> None:
        """STREAMING: the decode's events to the client as they come, until DONE, FAILED_FINAL or
        CLIENT_GONE."""
        events = self.pending
        self.pending = []
        while True:
            chunk, finished = self._outgoing(events)
            if chunk and not await self._write(out, chunk):
                return
            if finished:  # the client has the whole answer; the connection goes back to its pool by itself
                self.advance(Signal.END)
                return
            try:
                data = await self.legs.read(self.resp)
            except TimeoutError:
                self.broke = (f"decode worker sent nothing for {self.legs.cfg.stream_idle_timeout_secs:g}s "
                              "(--stream-idle-timeout-secs): presumed gone")
                self.advance(Signal.BROKE)
                return
            except LEG_ERRORS as e:
                self.broke = f"decode leg failed mid-stream: {e!r}"
                self.advance(Signal.BROKE)
                return
            if not data:  # the decode stream's end: the bytes of an event it did not end go as they are
                rest, self.splitter.rest = self.splitter.rest, b""
                if not rest or await self._write(out, rest):
                    self.advance(Signal.END)
                return
            events = self.splitter.feed(data)

    def _outgoing(self, events: list[Event]) -> tuple[bytes, bool]:
        """The bytes to relay for `events` (up to [DONE]), and whether [DONE] is among them."""
        parts = []
        for event in events:
            self.advance(Signal.EVENT)
            kind = event.kind  # before the logprobs merge rewrites the event
            if event.data is not None:
                self.trace.events += 1
            if kind is Kind.ERROR:  # the decode's request failed after its stream began
                self.decode_failed = True
            parts.append(event.raw if self.merger is None else self.merger.rewrite(event))
            if kind is Kind.DONE:
                return b"".join(parts), True
        return b"".join(parts), False

    async def _write(self, out: web.StreamResponse, data: bytes) -> bool:
        try:
            await out.write(data)
        except ConnectionError:
            self.advance(Signal.HUNG_UP)
            return False
        return True
