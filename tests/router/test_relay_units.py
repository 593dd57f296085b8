"""The relay's parts alone, in process: SSE framing on recorded streams cut at every boundary, the retry
table, and one attempt's state machine driven by scripted legs (no sockets)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from router.config import RouterConfig
from router.legs import LegAnswer, Legs
from router.metrics import Metrics
from router.registry import Worker
from router.relay import TRANSITIONS, Attempt, Signal, State
from router.retry import RETRY_TABLE, Budget, Failure, Kind, Retries
from router.sse import Event, Splitter, events
from router.sse import Kind as EventKind


def _data(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
TOKEN = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
TRICKY = {"text": "\n\ndata: [DONE]\n\n", "meta_info": {}}  # a token whose text spells the end
NODE_ERROR = {"error": {"message": "KV transfer failed", "type": "internal_error", "code": "kv_transfer"}}
OWN_ERROR = {"error": {"message": "too long", "type": "invalid_request_error", "code": None}}
CHAT = b": keep-alive\n\n" + _data(ROLE) + _data(TOKEN) + _data(TRICKY) \
    + _data(OWN_ERROR) + b"data: [DONE]\n\n"
CHAT_KINDS = [EventKind.COMMENT, EventKind.PREAMBLE, EventKind.TOKEN, EventKind.TOKEN, EventKind.ERROR,
              EventKind.DONE]


# ---------------------------------------------------------------------------------------------- SSE framing

def _framed(chunks) -> list[Event]:
    splitter = Splitter()
    out = [e for c in chunks for e in splitter.feed(c)]
    assert splitter.rest == b""
    return out


def test_a_recorded_stream_frames_the_same_however_its_reads_split_it():
    whole = _framed([CHAT])
    assert [e.kind for e in whole] == CHAT_KINDS
    assert b"".join(e.raw for e in whole) == CHAT
    for i in range(1, len(CHAT)):  # every two-read split, the cut inside a line, a JSON string or "\n\n"
        assert [e.raw for e in _framed([CHAT[:i], CHAT[i:]])] == [e.raw for e in whole], i
    for i in range(1, len(CHAT) - 1, 7):  # three reads
        j = i + (len(CHAT) - i) // 2
        assert [e.kind for e in _framed([CHAT[:i], CHAT[i:j], CHAT[j:]])] == CHAT_KINDS
    assert [e.kind for e in _framed([bytes([b]) for b in CHAT])] == CHAT_KINDS  # a byte a read


def test_events_are_told_apart_and_their_json_read_once():
    token = Event(_data(TOKEN))
    assert token.kind is EventKind.TOKEN and token.obj is token.obj and token.obj == TOKEN
    err = Event(_data(NODE_ERROR))
    assert err.kind is EventKind.ERROR and err.error["code"] == "kv_transfer"
    # no space after ':'
    assert Event(b"data:" + json.dumps(TOKEN).encode() + b"\n\n").kind is EventKind.TOKEN
    assert Event(b"data: not json\n\n").kind is EventKind.OTHER and Event(b"data: not json\n\n").error == {}
    assert Event(b"\n\n").kind is EventKind.COMMENT  # an empty event, as a keep-alive
    # a role chunk that also carries content, a finish reason or usage is a token event
    for choice in ({"delta": {"role": "assistant", "content": "x"}}, {"delta": {}, "finish_reason": "stop"}):
        assert Event(_data({"choices": [choice]})).kind is EventKind.TOKEN
    assert Event(_data({**ROLE, "usage": {"prompt_tokens": 1}})).kind is EventKind.TOKEN


def test_a_whole_body_keeps_a_last_event_without_its_empty_line():
    assert [e.kind for e in events(_data(TOKEN) + b"data: [DONE]")] == [EventKind.TOKEN, EventKind.DONE]


# ---------------------------------------------------------------------------------------------- retry table

def _worker(kind: str, name: str) -> Worker:
    return Worker(f"http://{name}:1", kind, 8998 if kind == "prefill" else None, RouterConfig())


def test_the_retry_table_gives_each_failure_its_budget():
    d = _worker("decode", "d0")
    others = {"yes": True}
    cfg = RouterConfig(retry_max_retries=3)
    retries = lambda: Retries(cfg, Metrics(), lambda w: others["yes"], "rid")  # noqa: E731

    def again(kind, status, attempt=0, r=None, body=b"{}"):
        return (r or retries()).allows(Failure(kind, status, "x", d, body), attempt)

    assert not again(Kind.ANSWER, 429) and not again(Kind.ANSWER, 504) and not again(Kind.ANSWER, 400)
    assert again(Kind.ANSWER, 500) and again(Kind.BROKEN, 504) and again(Kind.LEAD_ERROR, 502)
    assert not again(Kind.ANSWER, 500, attempt=2)  # the third attempt of three is the last
    r = retries()
    assert again(Kind.ANSWER, 503, r=r) and not again(Kind.ANSWER, 408, attempt=1, r=r)  # once per request
    others["yes"] = False  # no other worker of its kind: no second try for an overload
    assert not again(Kind.LEAD_ERROR, 503)
    assert again(Kind.NO_WORKERS, 503) and not again(Kind.DECODES_FULL, 429) \
        and not again(Kind.BAD_REQUEST, 400)
    assert {budget for budget in RETRY_TABLE.values()} == set(Budget)
    r = Retries(RouterConfig(retry_max_retries=2, retry_initial_backoff_ms=1),
                Metrics(), lambda w: True, "rid")
    assert asyncio.run(r.again(Failure(Kind.BROKEN, 502, "x", d), 0)) and r.metrics.retries == 1
    assert not asyncio.run(r.again(Failure(Kind.BROKEN, 502, "x", d), 1)) and r.metrics.retries == 1


# ---------------------------------------------------------------------------------------------- state machine

def test_the_transitions_start_waiting_and_end_in_a_final_state():
    assert {s for s, _ in TRANSITIONS} == {State.WAITING_FIRST_TOKEN, State.STREAMING}
    ends = set(TRANSITIONS.values()) - {State.WAITING_FIRST_TOKEN, State.STREAMING}
    assert ends == {State.DONE, State.FAILED_RETRYABLE, State.FAILED_FINAL, State.CLIENT_GONE}
    attempt = Attempt(None, None, None, None, None, (b"", b""), b"", [], "r", None)
    assert attempt.advance(Signal.LEAD) is State.STREAMING
    with pytest.raises(RuntimeError, match="STREAMING got FAILED"):  # nothing is retried once streaming
        attempt.advance(Signal.FAILED)
    assert attempt.advance(Signal.BROKE) is State.FAILED_FINAL
    with pytest.raises(RuntimeError):
        attempt.advance(Signal.EVENT)


class FakeResponse:
    """A decode stream's response: its reads scripted (bytes, an exception to raise, or seconds to wait)."""

    def __init__(self, status: int, reads, body: bytes = b"") -> None:
        self.status, self.reads, self.body, self.headers, self.closed = status, list(reads), body, {}, False

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        while self.reads and isinstance(self.reads[0], float):
            await asyncio.sleep(self.reads.pop(0))
        if not self.reads:
            return b""
        r = self.reads.pop(0)
        if isinstance(r, BaseException):
            raise r
        return r

    async def read(self) -> bytes:
        return self.body

    def close(self) -> None:
        self.closed = True


class ScriptedLegs(Legs):
    """Legs whose network is a script: the prefill leg's answer, the decode stream's response; the aborts
    recorded by worker name."""

    def __init__(self, prefill: LegAnswer | BaseException, decode: FakeResponse,
                 prefill_delay: float) -> None:
        super().__init__(RouterConfig(), Metrics())
        self.prefill, self.decode, self.prefill_delay, self.aborted = prefill, decode, prefill_delay, []

    async def _fetch(self, w, path, payload, headers):
        await asyncio.sleep(self.prefill_delay)
        if isinstance(self.prefill, BaseException):
            raise self.prefill
        return self.prefill

    async def open_stream(self, w, path, payload, headers):
        return self.decode

    def abort(self, w, rids):
        self.aborted.append(w.url.split("//")[1].split(":")[0])


def _writer(sent: list[bytes], fail: bool) -> mock.Mock:
    """The client's side of the connection: what the router wrote, or a client that is gone."""
    async def write(data) -> None:
        if fail:
            raise ConnectionResetError("client gone")
        sent.append(bytes(data))

    async def nothing(*a) -> None:
        pass

    writer = mock.Mock()
    writer.write, writer.write_headers, writer.write_eof, writer.drain = write, nothing, nothing, nothing
    return writer


OK = LegAnswer(200, b'{"meta_info": {}}', "application/json", None, None)


def _run(reads, prefill=OK, status=200, client_fails=False, body=b"", prefill_delay=0.01):
    legs = ScriptedLegs(prefill, FakeResponse(status, reads, body), prefill_delay)
    p, d = _worker("prefill", "p0"), _worker("decode", "d0")
    req = SimpleNamespace(path="/v1/chat/completions", stream=True, return_logprob=False)
    trace = SimpleNamespace(first_byte=0.0, events=0)
    sent: list[bytes] = []
    writer = _writer(sent, client_fails)

    async def go():
        request = make_mocked_request("POST", req.path, writer=writer)
        attempt = Attempt(legs, legs.metrics, req, p, d, (b"{}", b"{}"), b"", ["rid-1"], "rid-1", trace)
        result = await attempt.run(request)
        await asyncio.sleep(0.05)  # the legs left running end
        return attempt, result

    attempt, result = asyncio.run(go())
    return attempt, result, b"".join(sent), legs, d


def test_keep_alives_and_the_role_chunk_wait_for_the_first_token_cut_anywhere():
    for i in range(1, len(CHAT), 11):
        attempt, _, sent, legs, d = _run([CHAT[:i], CHAT[i:]])
        assert attempt.state is State.DONE and sent == CHAT, i
        assert not legs.decode.closed and d.breaker.failures == type(d.breaker.failures)()
    assert attempt.trace.events == 5  # the data events relayed, [DONE] included
    # the request's own error event came through: the prefill leg, still running, is dropped
    attempt, _, _, legs, _ = _run([CHAT], prefill_delay=1.0)
    assert attempt.decode_failed and legs.metrics.orphan_aborts == 1 and legs.aborted == ["p0"]


def test_a_node_error_before_the_first_token_is_a_retryable_failure_with_nothing_sent():
    reads = [b": keep-alive\n\n" + _data(ROLE), _data(NODE_ERROR) + b"data: [DONE]\n\n"]
    attempt, result, sent, legs, d = _run(reads)
    assert attempt.state is State.FAILED_RETRYABLE and sent == b""
    assert isinstance(result, Failure) and result.kind is Kind.LEAD_ERROR and result.status == 500
    assert result.err_type == "kv_transfer" and legs.metrics.reruns_before_first_token == 1
    assert legs.decode.closed and legs.aborted == ["p0"]  # the prefill leg waiting for its KV is aborted


def test_the_prefill_legs_failure_before_the_first_token_ends_the_attempt_and_after_it_does_not():
    reads = [b": keep-alive\n\n", 0.5, _data(TOKEN)]  # the prefill fails while the decode waits for its KV
    attempt, result, sent, legs, _ = _run(reads, prefill=ConnectionResetError("gone"))
    assert attempt.state is State.FAILED_RETRYABLE and result.kind is Kind.BROKEN and result.status == 502
    assert sent == b"" and legs.aborted == ["d0"]  # the decode leg it fed is aborted
    reads = [_data(TOKEN), 0.3, b"data: [DONE]\n\n"]  # the prefill fails after the first token
    attempt, result, sent, legs, _ = _run(reads, prefill=ConnectionResetError("gone"), prefill_delay=0.1)
    assert attempt.state is State.DONE and sent == _data(TOKEN) + b"data: [DONE]\n\n"


def test_a_decode_error_answer_and_a_broken_stream():
    attempt, result, sent, legs, _ = _run([], status=503, body=b'{"error": {}}')
    assert attempt.state is State.FAILED_RETRYABLE and (result.kind, result.status) == (Kind.ANSWER, 503)
    assert result.body == b'{"error": {}}' and sent == b""
    attempt, result, sent, legs, d = _run([_data(TOKEN), ConnectionResetError("decode node gone")])
    assert attempt.state is State.FAILED_FINAL and legs.metrics.stream_errors == 1 and "d0" in legs.aborted
    tail = sent.split(b"\n\n")
    assert sent.startswith(_data(TOKEN)) and b"upstream_error" in tail[-3] and tail[-2] == b"data: [DONE]"
    assert len(d.breaker.failures) == 1


def test_a_client_gone_mid_stream_aborts_both_legs():
    attempt, result, sent, legs, _ = _run([_data(TOKEN), _data(TOKEN)], client_fails=True, prefill_delay=1.0)
    assert attempt.state is State.CLIENT_GONE and legs.metrics.client_disconnects == 1
    assert sorted(legs.aborted) == ["d0", "p0"]


def test_a_node_error_before_the_first_token_counts_against_its_breaker():
    crash = {"error": {"message": "the forward raised", "type": "internal_error"}}
    attempt, result, _, _, d = _run([_data(crash) + b"data: [DONE]\n\n"])
    assert attempt.state is State.FAILED_RETRYABLE and result.status == 500
    # not cleared by the stream's end, so a node that keeps failing trips it
    assert len(d.breaker.failures) == 1
    attempt, _, _, _, d = _run([_data(NODE_ERROR) + b"data: [DONE]\n\n"])
    assert len(d.breaker.failures) == 0  # a failed KV transfer is the pair's, not the decode node's


def test_a_retry_avoids_the_failed_pair_and_every_worker_whose_leg_broke():
    from router.dispatch import Dispatcher
    from router.policies import make_policy

    cfg = RouterConfig(policy="round_robin")
    p0, p1 = _worker("prefill", "p0"), _worker("prefill", "p1")
    d0, d1 = _worker("decode", "d0"), _worker("decode", "d1")
    for w in (p0, p1, d0, d1):
        w.healthy = True
    registry = SimpleNamespace(prefill=[p0, p1], decode=[d0, d1])
    dispatcher = Dispatcher(cfg, registry, Metrics(), make_policy("round_robin", cfg),
                            make_policy("round_robin", cfg))
    dispatcher.capacity = None
    # p1 broke on the first attempt, the pair (p0, d0) failed on the second: p1 is still not tried again
    for _ in range(4):
        p, d = dispatcher.pick(None, (p0, d0), None, (p1,))
        assert (p, d) == (p0, d1)
    # with one worker of a kind left up, it is tried again rather than none
    p1.healthy = False
    assert dispatcher.pick(None, (p0, d0), None, (p0,))[0] is p0
