"""Client request validation (400 naming the field, with the node's own rules: the protocol structs and
`common/openai_params.py`) and bootstrap/rid injection into the original JSON."""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass

import msgspec

from common.api_fields import decode_request
from common.openai_params import sampling_params
from common.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
    convert,
    item_rids,
    normalize_hosts,
)
from router.registry import Worker

_TYPES = {"/generate": GenerateRequest, "/v1/completions": CompletionRequest,
          "/v1/chat/completions": ChatCompletionRequest}
_INJECTED = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank")
_NO_LIMIT = 2**31 - 1  # max_new_tokens checked here when the client set none (the node knows the context)
_encode = msgspec.json.encode


@dataclass(slots=True)
class ParsedRequest:
    path: str
    body: bytes  # the client's bytes, forwarded with fields spliced in
    obj: dict
    stream: bool
    return_logprob: bool
    batch: int | None  # number of inputs when the request is a batch
    client_rid: str | list[str] | None
    text: str | None  # for cache_aware
    dp_rank: int | None = None  # the client's `data_parallel_rank` (with --dp-aware: the decode group)


def _ids_text(ids) -> str:
    try:
        return "".join(map(chr, ids))
    except (TypeError, ValueError, OverflowError):
        return str(ids)


def _verify_sampling(sp, where: str) -> None:
    convert(sp, SamplingParams, where).verify(where)


def parse(path: str, body: bytes, need_text: bool) -> ParsedRequest:
    obj, req = decode_request(body, _TYPES[path])
    # a client's bootstrap_host/port/room are checked with the nodes' rule (the struct types bound the
    # port and room), then replaced by the router's own in `inject`, as sglang-router does
    normalize_hosts(req.bootstrap_host)
    text = None
    batch = None
    if path == "/generate":
        if (req.text is None) == (req.input_ids is None):
            raise BadRequest("exactly one of `text` and `input_ids` is required")
        if isinstance(req.text, list):
            if not req.text:
                raise BadRequest("`text` must not be an empty list")
            batch = len(req.text)
        elif req.input_ids is not None:
            if not req.input_ids:
                raise BadRequest("`input_ids` must not be empty")
            if isinstance(req.input_ids[0], list):
                batch = len(req.input_ids)
        sp = req.sampling_params
        if isinstance(sp, list):
            if batch is None or len(sp) != batch:
                raise BadRequest(f"`sampling_params` list has {len(sp)} entries for a batch of {batch or 1}")
            for i, one in enumerate(sp):
                _verify_sampling(one, f"sampling_params[{i}]")
        elif sp is not None:
            _verify_sampling(sp, "sampling_params")
        copies = {one.get("n", 1) for one in (sp if isinstance(sp, list) else [sp or {}])}
        if len(copies) > 1:
            raise BadRequest("`sampling_params.n` must be the same for every prompt of a batch")
        n = copies.pop()
        return_logprob = any(req.return_logprob) \
            if isinstance(req.return_logprob, list) else req.return_logprob
        if need_text:
            if req.text is not None:
                text = req.text if isinstance(req.text, str) else req.text[0]
            else:
                text = _ids_text(req.input_ids[0] if batch else req.input_ids)
    elif path == "/v1/completions":
        p = req.prompt
        if isinstance(p, list):
            if not p:
                raise BadRequest("`prompt` must not be empty")
            if isinstance(p[0], str | list):
                batch = len(p)
        elif not p:
            raise BadRequest("`prompt` must not be empty")
        sampling_params(req, _NO_LIMIT)
        n = req.n
        return_logprob = req.logprobs is not None
        if need_text:
            first = p[0] if batch else p
            text = first if isinstance(first, str) else _ids_text(first)
    else:
        if not req.messages:
            raise BadRequest("`messages` must not be empty")
        sampling_params(req, _NO_LIMIT)
        n = req.n
        return_logprob = req.logprobs
        if need_text:
            text = "\n".join(m.content for m in req.messages if isinstance(m.content, str))
    if n > 1:  # n copies of each prompt: a batch of prompts x n items, one room each
        batch = (batch or 1) * n
    if isinstance(req.rid, list) and len(req.rid) != (batch or 1):
        raise BadRequest(f"`rid` list has {len(req.rid)} entries for a batch of {batch or 1}")
    return ParsedRequest(path, body, obj, req.stream, bool(return_logprob), batch, req.rid, text,
                         req.data_parallel_rank)


def new_rids(req: ParsedRequest, attempt: int = 0, request_id: str | None = None) -> str | list[str]:
    """Request ids for both legs of one attempt: the client's own when it gave them (in the body), else
    the router's request id (the client's X-Request-ID, or a fresh one), so the router's and the nodes'
    log lines of one request carry the same id; with `-retryN` from the second attempt on (the abort of
    an abandoned attempt must never meet its retry on a node, where it would end it, nor a node refuse
    the retry's rid as still in use)."""
    rid = req.client_rid if req.client_rid is not None else request_id or uuid.uuid4().hex
    if attempt:
        rid = [f"{r}-retry{attempt}" for r in rid] if isinstance(rid, list) else f"{rid}-retry{attempt}"
    return rid if isinstance(rid, list) or req.batch is None or req.client_rid is not None \
        else item_rids(rid, req.batch)


def rid_list(req: ParsedRequest, rids: str | list[str]) -> list[str]:
    """The ids the nodes run the items under: one id for a batch is one per item there."""
    if isinstance(rids, list):
        return rids
    return [rids] if req.batch is None else item_rids(rids, req.batch)


def combine(congruences) -> tuple[int, int] | None:
    """The rooms x with x = a (mod n) for every (a, n) of `congruences`, as (r, m): x = r (mod m); None
    when they contradict each other (a node places room x on DP group x mod its dp_size)."""
    r, m = 0, 1
    for a, n in congruences:
        g = math.gcd(m, n)
        if (a - r) % g:
            return None
        t = (a - r) // g * pow(m // g, -1, n // g) % (n // g)
        r, m = (r + m * t) % (m // g * n), m // g * n
    return r, m


def _room(congruences) -> int:
    """A random room (0..2**63-1) meeting `congruences` (which `combine`)."""
    r, m = combine(congruences)
    return r + random.getrandbits(62) // m * m


def _rooms(n: int, congruences) -> list[int]:
    rooms = {_room(congruences) for _ in range(n)}
    while len(rooms) < n:
        rooms.add(_room(congruences))
    return list(rooms)


def inject(req: ParsedRequest, prefill: Worker | None, rids: str | list[str], congruences=(),
           decode_rank: int | None = None) -> tuple[bytes, bytes, int | list[int] | None]:
    """The client's JSON with bootstrap_host/port/room and rid set: (the prefill leg's bytes, the decode
    leg's, the room(s)). The rooms meet `congruences`, (group, dp_size) pairs that put the request on
    chosen DP groups of the nodes; with `decode_rank` (--dp-aware) the decode leg names its group in
    `data_parallel_rank` too. The prefill leg never carries one. With no `prefill` (the decode worker
    prefills the request itself: --local-prefill-queue) the JSON has no rendezvous and no room."""
    n = req.batch
    if prefill is None:
        room, extra = None, {}
    elif n is None:
        room = _room(congruences)
        extra = {"bootstrap_host": prefill.bootstrap_host, "bootstrap_port": prefill.bootstrap_port,
                 "bootstrap_room": room}
    else:
        room = _rooms(n, congruences)
        extra = {"bootstrap_host": [prefill.bootstrap_host] * n,
                 "bootstrap_port": [prefill.bootstrap_port] * n, "bootstrap_room": room}
    obj = req.obj
    if rids != req.client_rid:
        extra["rid"] = rids
    if any(k in obj for k in _INJECTED) or ("rid" in extra and "rid" in obj):
        merged = {k: v for k, v in obj.items() if k not in _INJECTED}
        merged.update(extra)
        payload = _encode(merged)
    # splice the fields in before the closing brace: no re-encoding of a possibly large prompt
    elif obj and extra:
        payload = b"".join((req.body.rstrip()[:-1], b",", _encode(extra)[1:]))
    elif obj:
        payload = req.body
    else:
        payload = _encode(extra)
    if decode_rank is None:
        return payload, payload, room
    return payload, b"".join((payload[:-1], b',"data_parallel_rank":', str(decode_rank).encode(), b"}")), room
