"""The HTTP rules every endpoint of a node shares: JSON errors in OpenAI's shape (a 429 carries
`Retry-After`), JSON body reading, SSE framing, the per-item fields of a request (rid and the PD
rendezvous), the input caps every generation route applies (batch size, top logprobs) and the life of
submitted requests (`respond`). `app.py` (SGLang-native endpoints) and `openai_api.py` both build on it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import uuid
from typing import Any

import msgspec
from aiohttp import web

from common.api_fields import decode_request
from common.protocol import (
    ERR_TYPE_HEADER,
    BadRequest,
    SamplingParams,
    check_rid,
    decode_json,
    error_body,
    item_rids,
    normalize_hosts,
)
from common.server.request_state import ReqState
from common.server.tokenizer_manager import TokenizerManager

# the client's X-Request-ID (checked by the middleware): the rid of a request whose body names none
REQUEST_ID_HEADER = "X-Request-ID"
incoming_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

TM_KEY = web.AppKey("tm", TokenizerManager)
INFO_KEY = web.AppKey("info", dict)
# a full queue drains as running requests finish: a client may try again after about this long
RETRY_AFTER_SECONDS = 1


# ---------------------------------------------------------------------------------------------- bodies
def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   code: str | None = None) -> web.Response:
    if status == 429:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS), **(headers or {})}
    return web.json_response(error_body(status, message, code), status=status, headers=headers, dumps=dumps)


async def read_json(request: web.Request, type_: type) -> Any:
    return decode_json(await request.read(), type_)


async def read_request(request: web.Request, type_: type) -> Any:
    """A generation endpoint's body, its fields screened first (`common/api_fields.py`)."""
    return decode_request(await request.read(), type_)[1]


async def sse_start(request: web.Request) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    rid = incoming_request_id.get()
    if rid:
        headers[REQUEST_ID_HEADER] = rid
    resp = web.StreamResponse(status=200, headers=headers)
    await resp.prepare(request)
    return resp


async def sse_send(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + dumps(obj).encode() + b"\n\n")


async def stream_wait(resp: web.StreamResponse, tm: TokenizerManager, states: list[ReqState], notify) -> None:
    """`tm.wait` for a stream: while nothing happens, an SSE comment every --stream-keepalive-secs (clients
    skip comments; a router's idle timeout sees the node is alive while its request waits in a queue)."""
    every = tm.args.stream_keepalive_secs
    while True:
        if not every or notify.is_set():  # news waiting already: no timer for it (most streamed tokens)
            return await tm.wait(states, notify)
        try:
            async with asyncio.timeout(every):  # a timer handle, not the task `wait_for` makes each time
                return await tm.wait(states, notify)
        except TimeoutError:
            await resp.write(b": keep-alive\n\n")


async def sse_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


# ---------------------------------------------------------------------------------------------- input caps
def check_batch_size(tm: TokenizerManager, n: int, name: str) -> None:
    """A batch counts per prompt against --max-queued-requests and is admitted whole, so a larger one
    could never run: refuse it before tokenizing anything."""
    if n > tm.queue_limit:
        raise BadRequest(f"`{name}` has {n} prompts; a batch has at most {tm.queue_limit} "
                         "(--max-queued-requests)")


def check_top_logprobs(tm: TokenizerManager, n: int, name: str, cap: int | None = None) -> None:
    """Top logprobs per position (prompt positions too) are capped: `--max-top-logprobs-num`, or `cap`."""
    limit = tm.args.max_top_logprobs_num if cap is None else cap
    if not 0 <= n <= limit:
        raise BadRequest(f"`{name}` must be in [0, {limit}], got {n}")


# -------------------------------------------------------------------------------------------- per-item fields
def copy_of(sp: SamplingParams, j: int) -> SamplingParams:
    """The sampling parameters of copy j of a prompt sent with n > 1: each copy is a request of its own
    (n = 1); with a seed, copy j draws with seed + j, so the copies differ and the answer is still
    reproducible."""
    seed = sp.seed if sp.seed is None or j == 0 else sp.seed + j
    return msgspec.structs.replace(sp, n=1, seed=seed)


def per_item(value: Any, n: int, name: str, batch: bool) -> list[Any]:
    """One value per item of a field that is a scalar (shared by every item) or a list (one per item)."""
    if isinstance(value, list):
        if not batch:
            raise BadRequest(f"`{name}` is a list but the request is not a batch")
        if len(value) != n:
            raise BadRequest(f"`{name}` has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def check_role(args, host: Any, port: Any, room: Any) -> None:
    """Prefill/decode nodes only take requests carrying the PD rendezvous (a router injects it); a decode
    node started with --disaggregation-local-prefill also takes requests with none of its three fields."""
    mode = args.disaggregation_mode
    if mode == "null":
        return
    if host is None and port is None and room is None and args.disaggregation_local_prefill:
        return
    if host is None or port is None or room is None:
        raise BadRequest(f"this is a {mode} node; requests need bootstrap_host/bootstrap_port/bootstrap_room "
                         "(send them through a PD router)")


def item_fields(args, req, n: int, batch: bool) -> list[dict[str, Any]]:
    """The rid, the PD rendezvous (bootstrap_host/port/room) and the `priority` of each of the n items of a
    request, as
    `TokenizedRequest` keywords. Each field is a scalar or a list with one entry per item; one rid for a
    batch becomes `item_rids(rid, n)`; no rid is the client's X-Request-ID, else a fresh one per item. A batch
    on a PD node needs one
    room per item. Ports and rooms were range-checked when the body was decoded (`common.protocol`'s
    `BootstrapPort` / `BootstrapRoom`); hosts are checked here (`normalize_hosts`), on every node role."""
    rid = req.rid if req.rid is not None else incoming_request_id.get()
    if rid == "" or (isinstance(rid, list) and not all(rid)):
        raise BadRequest("`rid` must be a non-empty string (or a list of them, one per item)")
    rids = item_rids(rid, n) if batch and isinstance(rid, str) else per_item(rid, n, "rid", batch)
    rids = [r or uuid.uuid4().hex for r in rids]
    for i, r in enumerate(rids):
        check_rid(r, f"rid[{i}]" if isinstance(rid, list) else "rid")
    hosts = per_item(normalize_hosts(req.bootstrap_host), n, "bootstrap_host", batch)
    ports = per_item(req.bootstrap_port, n, "bootstrap_port", batch)
    rooms = per_item(req.bootstrap_room, n, "bootstrap_room", batch)
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        check_role(args, host, port, room)
    if n > 1 and args.disaggregation_mode != "null" and req.bootstrap_room is not None \
            and not isinstance(req.bootstrap_room, list):
        raise BadRequest(f"`bootstrap_room` must be a list with one room per item for a batch of {n}")
    dp_ranks = data_parallel_ranks(args, req.data_parallel_rank, rooms)
    prios = per_item(req.priority, n, "priority", batch)
    return [{"rid": r, "bootstrap_host": h, "bootstrap_port": p,
             "bootstrap_room": room, "priority": prio or 0, "data_parallel_rank": dp}
            for r, h, p, room, prio, dp in zip(rids, hosts, ports, rooms, prios, dp_ranks, strict=True)]


def data_parallel_ranks(args, rank: int | None, rooms: list[int | None]) -> list[int | None]:
    """The DP group each item must run on: the request's `data_parallel_rank`, else (bootstrap_room mod
    --dp-size) for an item with a PD rendezvous, as both sides of a transfer agree on it; None lets the
    front end choose. A rank outside the node's groups, or one that contradicts the room, is refused."""
    size = getattr(args, "dp_size", 1)
    if rank is not None and rank >= size:
        raise BadRequest(f"`data_parallel_rank` = {rank}, but this node has --dp-size {size} (ranks "
                         f"0..{size - 1})")
    out = []
    for room in rooms:
        by_room = room % size if room is not None else None
        if rank is not None and by_room is not None and by_room != rank:
            raise BadRequest(f"`data_parallel_rank` = {rank} contradicts `bootstrap_room` {room}: a PD "
                             f"request runs on DP group bootstrap_room mod {size} = {by_room}")
        out.append(rank if rank is not None else by_room)
    return out


# ---------------------------------------------------------------------------------------------- answering
def err_type_header(st: ReqState) -> dict[str, str] | None:
    """The cause a router acts on (`ERR_TYPE_HEADER`), when the scheduler named one."""
    err_type = (st.finish_reason or {}).get("err_type")
    return {ERR_TYPE_HEADER: err_type} if err_type else None


def error_event(st: ReqState, status: int, message: str) -> dict:
    """A stream's error event for a request that failed after its stream began: the error body, its `code`
    the cause the scheduler named when it named one (`kv_transfer`: a router runs the request again on
    another pair when no token had reached its client yet)."""
    return error_body(status, message, code=(st.finish_reason or {}).get("err_type"))


def failed(st: ReqState) -> tuple[int, str] | None:
    """(status, message) when the request ended in an error the client should see as one."""
    if st.error_status:
        msg = (st.finish_reason or {}).get("message") or "request failed"
        return st.error_status, msg
    return None


async def respond(request: web.Request, tm: TokenizerManager, states: list[ReqState], notify, stream, body,
                  error_of=failed) -> web.StreamResponse:
    """The life of submitted requests after `tm.submit`: with `stream` (`await stream(resp)` writes the
    SSE events) answer as a stream; else wait for all of them and answer `body()` as JSON, or the
    first `error_of(state)` (status, message). Every state is released at the end with the status
    its client saw (499 when the handler was cancelled, e.g. the client went away)."""
    status = 200
    try:
        if stream is not None:
            # answer only once the scheduler took every item in, so a full queue (or any refusal) is an
            # HTTP status, not an error event in a 200 stream
            while not all(s.admitted or s.finished for s in states):
                await tm.wait(states, notify)
            for st in states:
                err = error_of(st)
                if err:
                    status = err[0]
                    return error_response(*err, headers=err_type_header(st))
            if any(s.output_ids or s.finished for s in states):
                notify.set()  # news that came with the admission: the stream sends it at once
            resp = await sse_start(request)
            try:
                await stream(resp)
            except ConnectionResetError:  # the client went away: release() aborts what is unfinished
                pass
            return resp
        while True:  # every item done, or the first failure (the others are aborted on release)
            for st in states:
                err = error_of(st) if st.finished else None
                if err:
                    status = err[0]
                    return error_response(*err, headers=err_type_header(st))
            if all(s.finished for s in states):
                break
            await tm.wait(states, notify)
        return web.json_response(body(), dumps=dumps)
    except BaseException:
        status = 499
        raise
    finally:
        for st in states:
            err = error_of(st)
            tm.release(st, err[0] if err else status)
