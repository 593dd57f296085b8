"""The aiohttp application of a node: middlewares, SGLang's `/generate`, the info and control endpoints,
and the routes of the OpenAI-compatible ones (`openai_api.py`).

Every error is JSON in OpenAI's shape (`http.py`); bad input is a 400 whose message names the field.
`create_app(...)` builds the app around a `TokenizerManager`; `launch.py` runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from common.protocol import (
    ERR_TYPE_HEADER,
    ROLE_SWITCH,
    AbortHTTPRequest,
    BadRequest,
    GenerateRequest,
    ModelNotFound,
    TokenizedRequest,
    check_request_id,
)
from common.server import openai_api
from common.server.http import (
    INFO_KEY,
    REQUEST_ID_HEADER,
    TM_KEY,
    check_batch_size,
    check_top_logprobs,
    copy_of,
    dumps,
    error_event,
    error_response,
    failed,
    incoming_request_id,
    item_fields,
    per_item,
    read_json,
    read_request,
    respond,
    sse_done,
    sse_send,
    stream_wait,
)
from common.server.metrics import CONTENT_TYPE
from common.server.openai_api import check_model
from common.server.openapi import Route, access_of, access_table, add_routes, unserved_routes, with_openapi
from common.server.role_switch_api import SwitchRoleRequest, handle_switch_role
from common.server.security import ADMIN, BY_BODY, OPEN, PUBLIC, Denied, Keys, bearer_token, check_access
from common.server.tokenize_api import DetokenizeRequest, TokenizeRequest, handle_detokenize, handle_tokenize
from common.server.tokenizer_manager import (
    QueueFull,
    ReqState,
    RoleSwitching,
    ServiceUnavailable,
    TokenizerManager,
)
from common.tracing import TRACEPARENT, incoming_traceparent
from common.version import VERSION

logger = logging.getLogger("server")

KEYS_KEY = web.AppKey("keys", Keys)
ACCESS_KEY = web.AppKey("access", dict)


# ---------------------------------------------------------------------------------------------- middlewares
def endpoint_label(path: str) -> str:
    """Metrics label of a route: "/v1/chat/completions" -> "chat_completions"."""
    p = path.strip("/")
    if p.startswith("v1/"):
        p = p[3:]
    return p.replace("/", "_") or "root"


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Errors as JSON in OpenAI's shape; the client's X-Request-ID (the rid of a request whose body names
    none) is checked and echoed on every answer."""
    rid = request.headers.get(REQUEST_ID_HEADER)
    resp = await _answer(request, handler, rid)
    if rid is not None and not resp.prepared and _valid_id(rid):
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def _valid_id(rid: str) -> bool:
    try:
        check_request_id(rid)
    except BadRequest:
        return False
    return True


async def _answer(request: web.Request, handler, rid: str | None) -> web.StreamResponse:
    def count(status: int) -> None:
        tm = request.app.get(TM_KEY)
        if tm is not None and request.match_info.route.resource is not None:  # known routes only
            tm.metrics.requests.inc(endpoint=endpoint_label(request.path), status=str(status))

    tp = request.headers.get(TRACEPARENT)
    if tp is not None and len(tp) <= 128:  # a W3C traceparent is 55 characters; a longer value is not one
        incoming_traceparent.set(tp)
    try:
        if rid is not None:
            incoming_request_id.set(check_request_id(rid))
        return await handler(request)
    except Denied as e:
        logger.info("rid=%s %s %s status=%d error=%s", rid or "-", request.method,
                    request.path, e.status, e.message)
        count(e.status)
        return error_response(e.status, e.message, headers=e.headers)
    except BadRequest as e:
        logger.info("rid=%s %s %s status=400 error=%s", rid or "-", request.method, request.path, e)
        count(400)
        return error_response(400, str(e))
    except ModelNotFound as e:
        logger.info("rid=%s %s %s status=404 error=%s", rid or "-", request.method, request.path, e)
        count(404)
        return error_response(404, str(e), code="model_not_found")
    except QueueFull as e:
        logger.info("%s %s status=429 error=%s", request.method, request.path, e)
        count(429)
        return error_response(429, str(e))
    except RoleSwitching as e:  # the router sends the request to another pair
        logger.info("%s %s status=503 error=%s", request.method, request.path, e)
        count(503)
        return error_response(503, str(e), code=ROLE_SWITCH, headers={ERR_TYPE_HEADER: ROLE_SWITCH})
    except ServiceUnavailable as e:
        logger.warning("%s %s status=503 error=%s", request.method, request.path, e)
        count(503)
        return error_response(503, f"service unavailable: {e}")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 405:
            msg = f"method {request.method} is not allowed on {request.path}"
        elif e.status == 404:
            msg = f"no route {request.path}"
        else:
            msg = e.reason or e.text or "error"
        logger.info("%s %s status=%d", request.method, request.path, e.status)
        count(e.status)
        return error_response(e.status, msg, headers=_keep_headers(e))


def _keep_headers(e: web.HTTPException) -> dict[str, str]:
    return {k: v for k, v in e.headers.items() if k in ("Allow", "WWW-Authenticate")}


def authorize(request: web.Request, access: str) -> None:
    """Raise Denied unless the caller may use a route of class `access` (`common.server.security`)."""
    check_access(access, request.path, bearer_token(request.headers), request.remote, request.app[KEYS_KEY],
                 accept_node_key=True)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    access = access_of(request, request.app[ACCESS_KEY])
    if access != BY_BODY:
        authorize(request, access)
    return await handler(request)


# ---------------------------------------------------------------------------------------------- /generate
def logprob_entries(tm: TokenizerManager, pairs: list[tuple[Any, int]], with_text: bool) -> list[list[Any]]:
    texts = tm.token_texts([p[1] for p in pairs]) if with_text else [None] * len(pairs)
    return [[p[0], p[1], t] for p, t in zip(pairs, texts, strict=True)]


def top_entries(tm: TokenizerManager, rows: list[Any], with_text: bool) -> list[Any]:
    return [None if r is None else logprob_entries(tm, list(r), with_text) for r in rows]


def generate_output(tm: TokenizerManager, st: ReqState, index: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": st.rid,
        "finish_reason": st.finish_reason,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "cached_tokens": st.cached_tokens,
        "e2e_latency": round(st.e2e_latency, 6),
    }
    if st.return_logprob:
        wt = st.return_text_in_logprobs
        meta["input_token_logprobs"] = logprob_entries(tm, st.input_logprobs, wt)
        meta["output_token_logprobs"] = logprob_entries(tm, st.output_logprobs, wt)
        if st.top_logprobs_num > 0:
            meta["input_top_logprobs"] = top_entries(tm, st.input_top_logprobs, wt)
            meta["output_top_logprobs"] = top_entries(tm, st.output_top_logprobs, wt)
    out: dict[str, Any] = {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


async def build_generate_requests(tm: TokenizerManager,
                                  req: GenerateRequest) -> tuple[list[TokenizedRequest], bool]:
    if req.text is not None and req.input_ids is not None:
        raise BadRequest("give either `text` or `input_ids`, not both")
    if req.text is None and req.input_ids is None:
        raise BadRequest("`text` or `input_ids` is required")
    if req.text is not None:
        batch = isinstance(req.text, list)
        prompts = req.text if batch else [req.text]
        field_name = "text"
        if batch and not prompts:
            raise BadRequest("`text` is an empty batch")
        check_batch_size(tm, len(prompts), "text")
        ids_list = await tm.encode_texts([(t, f"text[{i}]" if batch else "text")
                                          for i, t in enumerate(prompts)])
    else:
        ids = req.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        field_name = "input_ids"
        if batch:
            check_batch_size(tm, len(ids), "input_ids")
            ids_list = [tm.check_ids(x, f"input_ids[{i}]") for i, x in enumerate(ids)]
        else:
            ids_list = [tm.check_ids(ids, "input_ids")]
    n = len(ids_list)
    sps = per_item(req.sampling_params, n, "sampling_params", batch)
    want_lps = per_item(req.return_logprob, n, "return_logprob", batch)
    starts = per_item(req.logprob_start_len, n, "logprob_start_len", batch)
    top_ns = per_item(req.top_logprobs_num, n, "top_logprobs_num", batch)
    per_prompt = []
    for i, ids in enumerate(ids_list):
        where = f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
        sp = tm.make_sampling(sps[i], len(ids), where=where, prompt_field=field_name)
        check_top_logprobs(tm, top_ns[i], f"top_logprobs_num[{i}]" if isinstance(req.top_logprobs_num, list)
                           else "top_logprobs_num")
        if starts[i] < -1 or starts[i] >= len(ids):
            raise BadRequest(f"`logprob_start_len` must be -1 or in [0, {len(ids)}), got {starts[i]}")
        if per_prompt and sp.n != per_prompt[0][1].n:
            raise BadRequest(f"`{where}.n` is {sp.n}, but the first prompt asks for {per_prompt[0][1].n}: "
                             "every prompt of a batch takes the same n")
        per_prompt.append((ids, sp, i))
    copies = per_prompt[0][1].n
    check_batch_size(tm, n * copies, field_name)
    fields = item_fields(tm.args, req, n * copies, batch or copies > 1)
    out = []
    for k, (ids, sp, i) in enumerate(item for item in per_prompt for _ in range(copies)):
        out.append(TokenizedRequest(input_ids=ids, sampling=copy_of(sp, k % copies), stream=req.stream,
                                    return_logprob=bool(want_lps[i]), logprob_start_len=starts[i],
                                    top_logprobs_num=top_ns[i], **fields[k]))
    batch = batch or copies > 1
    return out, batch


async def _stream_generate(tm: TokenizerManager, states: list[ReqState], notify, resp: web.StreamResponse,
                           batch: bool) -> None:
    sent = [-1] * len(states)  # number of output ids at the last chunk of each item (-2: done)
    while True:
        await stream_wait(resp, tm, states, notify)
        for i, st in enumerate(states):
            if sent[i] == -2:
                continue
            if st.finished and failed(st):
                code, msg = failed(st)
                await sse_send(resp, error_event(st, code, msg))
                sent[i] = -2
                continue
            if len(st.output_ids) != sent[i] or st.finished:
                await sse_send(resp, generate_output(tm, st, i if batch else None))
                sent[i] = -2 if st.finished else len(st.output_ids)
        if all(s.finished for s in states):
            break
    await sse_done(resp)


async def handle_generate(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req = await read_request(request, GenerateRequest)
    check_model(request, req)
    treqs, batch = await build_generate_requests(tm, req)
    states, notify = tm.submit(treqs, endpoint="generate",
                               return_text_in_logprobs=req.return_text_in_logprobs)

    def body():
        outs = [generate_output(tm, st) for st in states]
        return outs if batch else outs[0]

    stream = (lambda resp: _stream_generate(tm, states, notify, resp, batch)) if req.stream else None
    return await respond(request, tm, states, notify, stream, body)


# ---------------------------------------------------------------------------------------------- info
async def handle_health(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    if not tm.healthy:
        return error_response(503, f"unhealthy: {tm.dead_reason}")
    return web.Response(status=200, text="")


async def handle_health_generate(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    if not tm.healthy:
        return error_response(503, f"unhealthy: {tm.dead_reason}")
    if tm.args.disaggregation_mode != "null":
        # a PD node cannot run a request on its own; check that its scheduler answers instead
        await tm.stats(timeout=20)
        return web.Response(status=200, text="")
    sp = tm.make_sampling({"max_new_tokens": 1, "temperature": 0.0}, 1)
    # one token on every DP group
    treqs = [TokenizedRequest(rid="health-" + uuid.uuid4().hex, input_ids=[0], sampling=copy_of(sp, 0),
                              data_parallel_rank=rank if tm.groups.size > 1 else None)
             for rank in range(tm.groups.size)]
    try:
        states, notify = tm.submit(treqs, endpoint="health_generate")
    except QueueFull as e:  # the scheduler has not taken in what was sent to it yet
        return error_response(503, f"health generation not admitted: {e}")
    try:
        deadline = time.time() + 60
        while not all(st.finished for st in states) and time.time() < deadline:
            try:
                await asyncio.wait_for(tm.wait(states, notify), max(deadline - time.time(), 0.001))
            except TimeoutError:
                break
        for st in states:
            where = f" (DP group {st.dp_rank})" if tm.groups.size > 1 else ""
            if not st.finished:
                tm.abort(st.rid, "health check timed out")
                return error_response(503, f"health generation did not finish within 60s{where}")
            if st.error_status == 429:  # the queue is full: the scheduler answered, so it is alive
                continue
            if failed(st) or (st.finish_reason or {}).get("type") == "abort":
                return error_response(503, f"health generation failed{where}: {st.finish_reason}")
        return web.Response(status=200, text="")
    finally:
        for st in states:
            tm.release(st, 200)


def model_card(request: web.Request) -> dict[str, Any]:
    info = request.app[INFO_KEY]
    return {"id": info["served_model_name"], "object": "model", "created": int(info["started"]),
            "owned_by": "pdserve", "root": info["model_path"],
            "max_model_len": request.app[TM_KEY].context_length}


async def handle_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(request)]})


async def handle_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: the served model's card, a 404 `model_not_found` for any other name."""
    card = model_card(request)
    if request.match_info["model"] != card["id"]:
        raise ModelNotFound(request.match_info["model"], card["id"])
    return web.json_response(card)


async def handle_model_info(request: web.Request) -> web.Response:
    info = request.app[INFO_KEY]
    tm = request.app[TM_KEY]
    return web.json_response({
        "model_path": info["model_path"], "tokenizer_path": tm.tokenizer_path, "is_generation": True,
        "served_model_name": info["served_model_name"],
        "model_config": tm.node_info.get("model_config", {}), "context_length": tm.context_length,
        "vocab_size": tm.vocab_size})


def _public_args(args) -> dict[str, Any]:
    d = dataclasses.asdict(args)
    if d.get("api_key"):
        d["api_key"] = "***"
    return d


async def handle_server_info(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    info = request.app[INFO_KEY]
    args = tm.args
    out = _public_args(args)
    out.update({
        "model_path": info["model_path"], "served_model_name": info["served_model_name"],
        "disaggregation_mode": args.disaggregation_mode,
        "disaggregation_bootstrap_port": args.disaggregation_bootstrap_port,
        "version": VERSION, "healthy": tm.healthy,
        "context_length": tm.context_length,
        # the values --sampling-defaults gave a request's left-out sampling fields
        "default_sampling_params": tm.sampling_defaults,
        "max_total_num_tokens": tm.node_info.get("max_total_tokens"),
        "page_size": tm.node_info.get("page_size", args.page_size),
        "max_running_requests": tm.node_info.get("max_running_requests", args.max_running_requests),
    })
    # what auto resolved to: device, dtypes, attention backend
    out.update(tm.node_info.get("placement") or {})
    # what a peer must share to pair with this node: the facts and their pairing key (common/fingerprint.py)
    out.update(compatibility=tm.node_info.get("compatibility"), fingerprint=tm.node_info.get("fingerprint"))
    stats = await tm.stats() if tm.healthy else {}
    if "kv_events_published" in stats:  # a KV event publisher runs (radix cache on): where routers subscribe
        from common.kv_events import KVEventsConfig

        kv = KVEventsConfig.parse(args.kv_events_config, args.host, args.dp_size)
        out.update(kv_events_endpoint=kv.endpoint, kv_events_replay_endpoint=kv.replay_endpoint or None,
                   kv_events_topic=kv.topic)
        if args.dp_size > 1:  # each group publishes its own cache (`kv_events_endpoint` is group 0's)
            groups = [kv.for_dp_rank(k) for k in range(args.dp_size)]
            out.update(kv_events_endpoints=[g.endpoint for g in groups],
                       kv_events_replay_endpoints=[g.replay_endpoint or None for g in groups])
    out.update(queue_figures(tm, stats))
    out["stats"] = stats
    out["internal_states"] = stats.get("dp") or [stats]
    return web.json_response(out, dumps=dumps)


def queue_figures(tm: TokenizerManager, stats: dict[str, Any]) -> dict[str, int]:
    """The queue limit and how deep the queue is (the scheduler's requests not running yet, never more
    than the limit); the requests sent to the scheduler that it has not admitted yet (some may still be
    refused); and the requests answered 429 so far (front end and scheduler)."""
    return {"max_queued_requests": tm.queue_limit,
            "num_queued_reqs": int(stats.get("num_queued_reqs", 0)),
            "num_pending_admission": len(tm.pending),
            "num_queue_full_refused": tm.queue_full_refused + int(stats.get("num_queue_full_refused", 0)),
            "num_early_aborts": tm.early_aborts_applied}


async def handle_get_load(request: web.Request) -> web.Response:
    """One entry per DP group (SGLang's shape): its requests (running, waiting in any queue, and on a
    prefill node sending their KV), waiting ones, KV tokens in use and queue limit."""
    tm = request.app[TM_KEY]
    s = await tm.stats()
    return web.json_response([_group_load(g, rank) for rank, g in enumerate(s.get("dp") or [s])])


def _group_load(s: dict[str, Any], rank: int) -> dict[str, int]:
    running = int(s.get("num_running_reqs", 0))
    queues = s.get("num_queue_reqs") or {}
    held = int(queues.get("inflight", 0)) if isinstance(queues, dict) else 0  # prefill: sending its KV
    waiting = int(s.get("num_queued_reqs", 0))  # every stage before running, the role's queues included
    out = {"dp_rank": rank, "num_reqs": running + waiting + held, "num_waiting_reqs": waiting,
           "num_tokens": int(s.get("num_tokens_used", 0)), "num_queued_reqs": waiting,
           "max_queued_requests": int(s.get("max_queued_requests", 0)),
           # what the group can still take in: KV tokens free or evictable, and on a decode node its free
           # preallocation rows and the requests waiting for one (the router's decode choice reads them)
           "kv_available_tokens": int(s.get("kv_free_tokens", 0)) + int(s.get("kv_evictable_tokens", 0))}
    if "prealloc_slots_free" in s:
        out["prealloc_slots_free"] = int(s["prealloc_slots_free"])
        out["num_prealloc_reqs"] = int(queues.get("prealloc", 0)) if isinstance(queues, dict) else 0
    return out


async def handle_version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def handle_metrics(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    if tm.healthy:
        try:
            await tm.stats(timeout=5)
        except ServiceUnavailable as e:
            logger.warning("metrics: no scheduler stats: %s", e)
    return web.Response(body=tm.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})


async def handle_abort(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    try:  # aborting one rid is a public call, aborting every request an admin's
        authorize(request, PUBLIC)
    except Denied:
        authorize(request, ADMIN)
    req = await read_json(request, AbortHTTPRequest)
    if req.abort_all:
        authorize(request, ADMIN)
        n = tm.abort_all()
        logger.info("abort_all: %d requests aborted", n)
        return web.json_response({"success": True, "aborted": n})
    if not req.rid:
        raise BadRequest("`rid` (or `abort_all: true`) is required")
    ok = tm.abort(req.rid)
    logger.info("rid=%s abort_request found=%s", req.rid, ok)
    return web.json_response({"success": ok, "aborted": int(ok)})


async def handle_flush_cache(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    result = await tm.flush_cache()
    ok = bool(result.get("flushed", result.get("success", True)))
    return web.json_response({"success": ok, **result}, status=200 if ok else 400)


# ---------------------------------------------------------------------------------------------- app
def node_routes() -> list[Route]:
    """Every route of a node with its body struct and access class (`/openapi.json` describes them)."""
    from common.protocol import ChatCompletionRequest, CompletionRequest

    gen, info = "generation", "information"
    return with_openapi([
        Route("POST", "/generate", handle_generate, GenerateRequest,
              summary=f"SGLang-native {gen}", stream=True),
        Route("POST", "/v1/completions", openai_api.handle_completions, CompletionRequest,
              summary=f"OpenAI completions {gen}", stream=True),
        Route("POST", "/v1/chat/completions", openai_api.handle_chat_completions, ChatCompletionRequest,
              summary=f"OpenAI chat {gen}", stream=True),
        Route("GET", "/v1/models", handle_models, summary="the served model"),
        Route("GET", "/v1/models/{model:.+}", handle_model, summary="the served model's card, by its name"),
        *unserved_routes(),
        *(Route("POST", p, handle_tokenize, TokenizeRequest, summary="text or chat messages to token ids")
          for p in ("/tokenize", "/v1/tokenize")),
        *(Route("POST", p, handle_detokenize, DetokenizeRequest, summary="token ids to text")
          for p in ("/detokenize", "/v1/detokenize")),
        *(Route("GET", p, handle_server_info, summary=f"server {info} (keys redacted)")
          for p in ("/server_info", "/get_server_info")),
        *(Route("GET", p, handle_model_info, summary=f"model {info}")
          for p in ("/model_info", "/get_model_info")),
        Route("GET", "/get_load", handle_get_load, summary="queue and token load"),
        Route("POST", "/abort_request", handle_abort, AbortHTTPRequest, access=BY_BODY,
              summary="abort one rid (public); abort_all is an admin call"),
        Route("POST", "/flush_cache", handle_flush_cache, access=ADMIN, summary="drop the prefix cache"),
        Route("POST", "/switch_role", handle_switch_role, SwitchRoleRequest, access=ADMIN,
              summary="drain, then serve the other PD role with the weights kept"),
        Route("GET", "/health", handle_health, access=OPEN, summary="liveness"),
        Route("GET", "/version", handle_version, access=OPEN, summary="the pdserve version"),
        Route("GET", "/health_generate", handle_health_generate, access=OPEN,
              summary="readiness: runs one step"),
        Route("GET", "/metrics", handle_metrics, access=OPEN, summary="Prometheus metrics (no secrets)"),
    ], "pdserve node", VERSION)


def create_app(tm: TokenizerManager, *, model_path: str, served_model_name: str | None = None,
               keys: Keys | None = None) -> web.Application:
    """The node's app; `keys` default to `tm.args`' key flags and the environment (`Keys.load`)."""
    if keys is None:
        keys = load_node_keys(tm.args)
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=64 * 1024 * 1024)
    app[TM_KEY] = tm
    app[KEYS_KEY] = keys
    app[INFO_KEY] = {"model_path": model_path, "started": time.time(),
                     "served_model_name": served_model_name or tm.args.served_model_name or tm.args.model}
    tm.metrics.model_name = app[INFO_KEY]["served_model_name"]  # the model_name label of every series
    routes = node_routes()
    app[ACCESS_KEY] = access_table(routes)
    add_routes(app, routes)
    return app


def load_node_keys(args) -> Keys:
    """The node's keys from its flags and the environment; raises KeySourceError naming the source."""
    return Keys.load(api_key=args.api_key, api_key_file=getattr(args, "api_key_file", None),
                     admin_api_key_file=getattr(args, "admin_api_key_file", None),
                     node_api_key_file=getattr(args, "node_api_key_file", None), logger=logger)
