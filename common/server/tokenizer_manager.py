"""The front end's side of a node: tokenizer, validation, ZMQ to/from the scheduler, per-request state.

* `encode_texts`, `check_ids`, `apply_chat_template`, `make_sampling`, `check_fits` turn client input
  into prompt ids and sampling parameters (raising `BadRequest` naming the field). Large inputs are
  tokenized (and chat templates rendered, long outputs detokenized) on a thread pool, never on the
  event loop, so `/health` and other streams keep answering; a text too long to fit the context in
  any case is refused before it is tokenized;
* `submit` registers the request states and sends them to scheduler rank 0 (ZMQ PUSH) of the DP group
  each is for (`common/server/data_parallel.py`; one group unless --dp-size). It refuses
  (`QueueFull`, HTTP 429) requests that would bring what is in the pipe to the scheduler and not yet
  admitted by it past --max-queued-requests; the scheduler admits or refuses (429) each request
  against its queues (`common/scheduler/intake.py: Admission`) and names the rids it admitted;
* a background task reads `BatchOut`/`StatsReport` (ZMQ PULL, shared by the groups) and updates the
  states: output ids,
  incremental text, logprobs, finish reason; every state of one HTTP request shares one
  `asyncio.Event`, so a handler can wait for "something changed" across a batch;
* `release` ends a request's life in the front end: a request that has not finished (its HTTP
  client went away, the handler failed) is aborted in the scheduler so its memory is freed.
* queries (`stats`, `flush_cache`) go to every group; their answers are merged into one.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from common.protocol import (
    AbortRequest,
    BadRequest,
    BatchOut,
    FlushCacheRequest,
    FromScheduler,
    SamplingParams,
    StatsQuery,
    StatsReport,
    TokenizedRequest,
    ToScheduler,
    convert,
)
from common.server.data_parallel import DPGroups, merge_stats
from common.server.detokenizer import IncrementalDetokenizer, special_token_ids, token_texts
from common.server.metrics import Metrics
from common.tracing import incoming_traceparent

logger = logging.getLogger("server")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has no max_new_tokens
# inputs up to this many characters are tokenized on the event loop: ~0.1-1 ms there, while a hop to
# the thread pool and back costs ~0.15 ms; longer ones go to the pool (10 MB of text take ~9 s)
INLINE_TOKENIZE_CHARS = 2048
# keyword arguments the server passes to the chat template itself (`chat_template_kwargs` may not)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                                      "tokenize", "return_dict", "return_tensors", "chat_template", "padding",
                                      "truncation", "max_length", "continue_final_message"})
# updates of up to this many tokens are detokenized on the event loop (the incremental window is a few
# tokens); a longer one (the whole answer of a long non-streamed request) goes to the pool
INLINE_DETOKENIZE_TOKENS = 512
TOKENIZER_THREADS = 2



EARLY_ABORTS_MAX = 10_000  # aborts of unknown rids remembered at most
EARLY_ABORT_TTL = 30.0  # seconds such an abort waits for its request

class ServiceUnavailable(RuntimeError):
    """The scheduler is gone or does not answer: HTTP 503."""


class QueueFull(RuntimeError):
    """--max-queued-requests is reached: HTTP 429 with Retry-After."""


def max_chars_per_token(tokenizer) -> int | None:
    """An upper bound on the characters of input text one token of this tokenizer covers, or None when
    it cannot be told (a normalizer may shrink the text; a slow tokenizer). Byte-level and metaspace
    tokens cover at most as many characters as their vocabulary strings have; added tokens match their
    content."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    try:
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:
        return None
    return max((len(t) for t in vocab), default=0) or None


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

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def e2e_latency(self) -> float:
        return (self.finished_time or time.time()) - self.created


class TokenizerManager:
    def __init__(self, args, model_dir: str, to_scheduler: str | list[str], from_scheduler: str,
                 metrics: Metrics | None = None, tokenizer=None):
        """`to_scheduler`: the address of each DP group's rank 0 (one string for a single group)."""
        self.args = args
        self.model_dir = model_dir
        self.tokenizer_path = args.tokenizer or model_dir
        template = None
        if getattr(args, "chat_template", None):
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        if tokenizer is None:
            from common.server.tokenizer_load import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_path, template)
        elif template is not None:
            tokenizer.chat_template = template
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self.metrics = metrics or Metrics()
        # filled from the scheduler's ready message by configure()
        self.node_info: dict[str, Any] = {}
        self.context_length = args.context_length or 0
        self.vocab_size = len(tokenizer)
        addrs = [to_scheduler] if isinstance(to_scheduler, str) else list(to_scheduler)
        self.groups = DPGroups(len(addrs))
        self.queue_limit = args.queued_requests_limit * len(addrs)  # --max-queued-requests per group
        self.max_token_chars = max_chars_per_token(tokenizer)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")
        self.pending: set[str] = set()  # rids sent to the scheduler, neither admitted nor finished yet
        self.queue_full_refused = 0  # requests answered 429 here (the scheduler counts its own)
        self.tracer = None  # common.tracing.Tracer with --enable-trace (set by launch)
        # ZMQ: a plain PUSH (sends never wait: NOBLOCK, unbounded queue) and an asyncio PULL
        self._ctx = zmq.Context()
        self._pushes = []
        for addr in addrs:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.bind(addr)
            self._pushes.append(push)
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(from_scheduler)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromScheduler)
        self.states: dict[str, ReqState] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._qids = itertools.count(1)
        self._recv_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self._token_text_cache: dict[int, str] = {}
        # aborts of rids not (yet) here: a router abandons a leg whose request may still be on its way
        # (in the socket, or being tokenized); that request is ended on arrival instead of waiting out
        # its bootstrap timeout with its room and memory
        self._early_aborts: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()
        self.early_aborts_applied = 0

    # ------------------------------------------------------------------ lifecycle
    def configure(self, ready: dict[str, Any], groups: list[dict[str, Any]] | None = None) -> None:
        """From rank 0's ready message (and with several DP groups, each group's rank 0's: the node's KV
        tokens and running requests are their sums)."""
        self.node_info = dict(ready)
        if groups and len(groups) > 1:
            for key in ("max_total_tokens", "max_running_requests"):
                self.node_info[key] = sum(int(g.get(key) or 0) for g in groups)
        self.context_length = int(ready.get("context_length") or self.context_length)
        mc = ready.get("model_config") or {}
        if mc.get("vocab_size"):
            self.vocab_size = int(mc["vocab_size"])

    def wait_connected(self, timeout: float) -> bool:
        """True once every DP group's first rank has connected to its `to_scheduler` socket (the ranks start
        before the front end binds, and ZMQ connects them on its next retry; a send before that finds no
        peer)."""
        deadline = time.monotonic() + timeout
        for push in self._pushes:
            if not push.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
                return False
        return True

    async def start(self) -> None:
        self._recv_task = asyncio.create_task(self._recv_loop(), name="tokenizer-manager-recv")

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):
                pass
        self.close_sockets()

    def close_sockets(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._ctx.closed:
            return
        self._pull.close(0)
        for push in self._pushes:
            push.close(0)
        self._ctx.term()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def mark_dead(self, reason: str) -> None:
        """A scheduler process died: fail every live request with 503, refuse new ones."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.metrics.healthy.set(0)
        for st in list(self.states.values()):
            if not st.finished:
                self._finish(st, {"type": "abort", "message": reason}, 503)
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailable(reason))

    # ------------------------------------------------------------------ ZMQ
    def _send(self, msg: ToScheduler, dp_rank: int = 0) -> None:
        if self.dead_reason is not None:
            raise ServiceUnavailable(self.dead_reason)
        try:
            self._pushes[dp_rank].send(self._encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ServiceUnavailable("the scheduler is not connected") from None

    async def _recv_loop(self) -> None:
        while True:
            try:
                data = await self._pull.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                # nothing more can arrive: every live request would wait forever
                logger.error("ZMQ receive from the scheduler failed: %s", e)
                self.mark_dead(f"the front end lost its scheduler (ZMQ receive failed: {e})")
                return
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as e:
                logger.error("undecodable message from the scheduler: %s", e)
                continue
            if isinstance(msg, BatchOut):
                for rid in msg.admitted:
                    self.pending.discard(rid)
                    st = self.states.get(rid)
                    if st is not None and not st.admitted:
                        st.admitted = True
                        st.notify.set()
                for u in msg.updates:
                    st = self.states.get(u.rid)
                    if st is not None and not st.finished:
                        try:
                            await self._apply_update(st, u)
                        except Exception:
                            logger.exception("rid=%s failed to apply an update", u.rid)
                            if not st.finished:
                                self._finish(st, {"type": "abort", "message": "internal error in the front end"},
                                             500)
            elif isinstance(msg, StatsReport):
                fut = self._queries.pop(msg.qid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)

    async def _apply_update(self, st: ReqState, u) -> None:
        now = time.time()
        new = list(u.new_token_ids)
        if new:
            if st.first_token_time is None:
                st.first_token_time = now
                self.metrics.ttft.observe(now - st.created)
                if len(new) > 1:
                    for _ in range(len(new) - 1):
                        self.metrics.itl.observe(0.0)
            else:
                gap = (now - (st.last_token_time or now)) / len(new)
                for _ in new:
                    self.metrics.itl.observe(gap)
            st.last_token_time = now
            st.output_ids.extend(new)
        st.prompt_tokens = u.prompt_tokens or st.prompt_tokens
        st.completion_tokens = u.completion_tokens
        st.cached_tokens = u.cached_tokens
        if u.output_logprobs:
            st.output_logprobs.extend(tuple(x) for x in u.output_logprobs)
        if u.output_top_logprobs:
            st.output_top_logprobs.extend([tuple(y) for y in x] for x in u.output_top_logprobs)
        if u.input_logprobs:
            st.input_logprobs.extend(tuple(x) for x in u.input_logprobs)
        if u.input_top_logprobs:
            st.input_top_logprobs.extend(None if x is None else [tuple(y) for y in x]
                                         for x in u.input_top_logprobs)
        if len(new) > INLINE_DETOKENIZE_TOKENS:
            # a long answer at once: decode it on the pool (updates of other requests wait behind it,
            # in order; the event loop does not)
            st.detok_busy = True
            try:
                await asyncio.get_running_loop().run_in_executor(self.pool, st.detok.step, new, u.finish_reason)
            finally:
                st.detok_busy = False
            if st.finished:  # ended meanwhile (--request-timeout): that end stands
                return
            new = []
        if u.finish_reason is not None:
            self._finish(st, u.finish_reason, u.error_status, new)
        else:
            st.detok.step(new)
            st.notify.set()

    def _finish(self, st: ReqState, reason: dict[str, Any], error_status: int = 0,
                new_ids: list[int] | None = None) -> None:
        self.pending.discard(st.rid)
        if not st.detok_busy:  # else the pool's step is the last one
            st.detok.step(new_ids or [], reason)
        st.finish_reason = reason
        st.error_status = error_status
        st.finished = True
        st.finished_time = time.time()
        if not st.completion_tokens:
            st.completion_tokens = len(st.output_ids)
        if not st.prompt_tokens:
            st.prompt_tokens = len(st.input_ids)
        st.notify.set()

    # ------------------------------------------------------------------ input → TokenizedRequest
    def _check_text(self, text: Any, field_name: str) -> str:
        if not isinstance(text, str):
            raise BadRequest(f"`{field_name}` must be a string")
        if not text:
            raise BadRequest(f"`{field_name}` is empty; a prompt needs at least one token")
        self._check_text_length(len(text), field_name)
        return text

    def _check_text_length(self, chars: int, field_name: str) -> None:
        """Refuse, before tokenizing it, a text with more characters than the context's tokens can cover."""
        k = self.max_token_chars
        if k and self.context_length and chars > self.context_length * k:
            raise BadRequest(f"`{field_name}` has {chars} characters: more than the context length of "
                             f"{self.context_length} tokens can hold (a token of this model covers at most {k} "
                             f"characters)")

    def _encode(self, text: str, field_name: str, add_special_tokens: bool) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise BadRequest(f"`{field_name}` tokenizes to no tokens")
        return list(ids)

    async def run_sized(self, size: int, inline_limit: int, fn, *args):
        """`fn(*args)` on the event loop when `size` is small, else on the tokenizer pool."""
        if size <= inline_limit:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def encode_texts(self, texts: list[tuple[str, str]], add_special_tokens: bool = True) -> list[list[int]]:
        """Prompt ids of each (text, field name); large inputs are tokenized off the event loop."""
        for text, name in texts:
            self._check_text(text, name)
        total = sum(len(t) for t, _ in texts)

        def encode_all() -> list[list[int]]:
            return [self._encode(t, name, add_special_tokens) for t, name in texts]

        return await self.run_sized(total, INLINE_TOKENIZE_CHARS, encode_all)

    async def encode_text(self, text: str, field_name: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_texts([(text, field_name)], add_special_tokens))[0]

    async def decode(self, ids: list[int]) -> str:
        """`tokenizer.decode(ids)`, off the event loop for long inputs (an echoed prompt)."""
        return await self.run_sized(len(ids), INLINE_DETOKENIZE_TOKENS, self.tokenizer.decode, ids)

    def check_ids(self, ids: Any, field_name: str) -> list[int]:
        if not isinstance(ids, list):
            raise BadRequest(f"`{field_name}` must be a list of token ids")
        if not ids:
            raise BadRequest(f"`{field_name}` is empty; a prompt needs at least one token")
        if self.context_length and len(ids) >= self.context_length:  # before looking at each id
            raise BadRequest(f"`{field_name}` has {len(ids)} tokens; the context length is "
                             f"{self.context_length} (the prompt plus at least one output token must fit)")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise BadRequest(f"`{field_name}[{i}]` must be an integer token id, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise BadRequest(f"`{field_name}[{i}]` = {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    async def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                                  kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                                  continue_final_message: bool = False,
                                  documents: list[dict[str, Any]] | None = None) -> list[int]:
        """Chat messages (and the tools and documents shown to the model) → prompt ids: the model's chat
        template with the generation prompt and the client's `chat_template_kwargs`; rendered and
        tokenized off the event loop when the messages are large."""
        size = sum(len(m.get("content") or "") for m in messages)
        return await self.run_sized(size, INLINE_TOKENIZE_CHARS, self._render_chat, messages, tools, kwargs or {},
                                    add_generation_prompt and not continue_final_message, continue_final_message,
                                    documents)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.tokenizer, "chat_template", None)
        return t if isinstance(t, str) or t is None else json.dumps(t)

    def _render_chat(self, messages: list[dict[str, Any]], tools, kwargs: dict[str, Any],
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     documents: list[dict[str, Any]] | None = None) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadRequest("`messages`: this model has no chat template; start the node with --chat-template FILE, "
                             "or send the prompt to /v1/completions")
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise BadRequest(f"`chat_template_kwargs.{reserved[0]}` is set by the server and cannot be given")
        try:
            text = tok.apply_chat_template(messages, tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tokenize=False,
                                           **kwargs)
        except Exception as e:  # jinja raises for messages a template refuses
            raise BadRequest(f"`messages` cannot be rendered by the model's chat template: {e}") from None
        self._check_text_length(len(text), "messages")
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("`messages` renders to an empty prompt")
        return list(ids)

    def make_sampling(self, raw: dict[str, Any] | None, prompt_len: int, *, where: str = "sampling_params",
                      prompt_field: str = "text") -> SamplingParams:
        """SGLang's `sampling_params` → verified SamplingParams that fit the context with the prompt."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise BadRequest(f"`{where}` must be a JSON object")
        sp = convert(raw, SamplingParams, where)
        if "max_new_tokens" not in raw:
            sp.max_new_tokens = self.room(prompt_len, DEFAULT_MAX_NEW_TOKENS)
        sp.verify(where)
        self.check_fits(sp, prompt_len, max_field=f"{where}.max_new_tokens", prompt_field=prompt_field)
        self.check_token_ids(sp, where)
        return sp

    def check_token_ids(self, sp: SamplingParams, where: str) -> None:
        """Token ids in the sampling parameters must be in the vocabulary."""
        for t, _ in sp.logit_bias_items() if sp.logit_bias else ():
            if t >= self.vocab_size:
                name = f"{where}.logit_bias.{t}" if where else f"logit_bias.{t}"
                raise BadRequest(f"`{name}` is outside the vocabulary [0, {self.vocab_size})")

    def room(self, prompt_len: int, limit: int | None = None) -> int:
        """How many tokens may follow the prompt in the context (at most `limit`)."""
        room = max(self.context_length - prompt_len, 0)
        return room if limit is None else min(room, limit)

    def check_fits(self, sp: SamplingParams, prompt_len: int, *, max_field: str, prompt_field: str) -> None:
        """The prompt plus max_new_tokens must fit the context; the error names the client's fields."""
        room = self.context_length - prompt_len
        if room <= 0:
            raise BadRequest(f"`{prompt_field}` has {prompt_len} tokens; the context length is "
                             f"{self.context_length} (the prompt plus at least one output token must fit)")
        if sp.max_new_tokens > room:
            raise BadRequest(f"`{max_field}` = {sp.max_new_tokens} plus the prompt's {prompt_len} tokens is "
                             f"{sp.max_new_tokens + prompt_len}, more than the context length "
                             f"{self.context_length}")

    # ------------------------------------------------------------------ submit / wait / release
    def submit(self, reqs: list[TokenizedRequest], *, endpoint: str = "generate",
               return_text_in_logprobs: bool = False) -> tuple[list[ReqState], asyncio.Event]:
        """Register and send the requests of one HTTP call; they share one notify event."""
        if self.dead_reason is not None:
            raise ServiceUnavailable(self.dead_reason)
        n = len(reqs)
        if n > self.queue_limit:  # handlers refuse it sooner, naming their field
            raise BadRequest(f"a batch of {n} prompts is more than --max-queued-requests ({self.queue_limit})")
        if len(self.pending) + n > self.queue_limit:
            # the scheduler has not taken in what is already in the pipe: do not grow it further
            self.queue_full_refused += n
            raise QueueFull(f"the node's queue is full: {len(self.pending)} requests wait to be admitted and "
                            f"{'a batch of ' + str(n) + ' requests' if n > 1 else 'a new request'} would pass "
                            f"--max-queued-requests={self.queue_limit}; retry later")
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise BadRequest("`rid` values in one batch must be distinct")
        for rid in rids:
            if rid in self.states:
                raise BadRequest(f"`rid` {rid!r} is already in use by a running request")
        notify = asyncio.Event()
        states = []
        now = time.time()
        ranks = self._place(reqs)
        for r, rank in zip(reqs, ranks, strict=True):
            sp = r.sampling
            detok = IncrementalDetokenizer(
                self.tokenizer, r.input_ids, skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
                stop_strings=sp.stop_strings(), no_stop_trim=sp.no_stop_trim, special_ids=self.special_ids)
            r.arrival_time = r.arrival_time or now
            st = ReqState(rid=r.rid, input_ids=r.input_ids, sampling=sp, detok=detok, notify=notify,
                          stream=r.stream, return_logprob=r.return_logprob, top_logprobs_num=r.top_logprobs_num,
                          return_text_in_logprobs=return_text_in_logprobs, endpoint=endpoint, created=now,
                          prompt_tokens=len(r.input_ids), dp_rank=rank)
            if self.tracer is not None:
                st.span = self.tracer.start("request", incoming_traceparent.get(),
                                            {"pdserve.rid": r.rid, "pdserve.endpoint": endpoint}, start_time=now)
                r.traceparent = self.tracer.traceparent_of(st.span)
            states.append(st)
        early = self._take_early_abort(rids)
        if early is not None:  # aborted before it arrived: it ends here, the scheduler never sees it
            for st in states:
                self._register(st)
                self._finish(st, {"type": "abort", "message": early})
            logger.info("rid=%s aborted before it arrived (%s)", rids[0], early)
            return states, notify
        for st, r in zip(states, reqs, strict=True):
            self._register(st)
            self.pending.add(st.rid)
            try:
                self._send(r, st.dp_rank)
            except ServiceUnavailable:
                for s in states:
                    self._unregister(s)
                    self.pending.discard(s.rid)
                raise
        timeout = getattr(self.args, "request_timeout", None)
        if timeout:
            loop = asyncio.get_running_loop()
            for st in states:
                st.deadline = loop.call_later(timeout, self._expire, st, timeout)
        return states, notify

    def _place(self, reqs: list[TokenizedRequest]) -> list[int]:
        """The DP group of each request of one HTTP call; numbers the items each group gets as a batch
        of its own (a group admits its items of the call together)."""
        ranks = [self.groups.choose(r.data_parallel_rank) for r in reqs]
        counts = collections.Counter(ranks)
        seen: collections.Counter[int] = collections.Counter()
        for r, rank in zip(reqs, ranks, strict=True):
            r.batch_size, r.batch_index = counts[rank], seen[rank]
            seen[rank] += 1
        return ranks

    def _register(self, st: ReqState) -> None:
        self.states[st.rid] = st
        self.groups.started(st.dp_rank)

    def _unregister(self, st: ReqState) -> None:
        if self.states.pop(st.rid, None) is not None:
            self.groups.ended(st.dp_rank)

    def _expire(self, st: ReqState, timeout: float) -> None:
        """--request-timeout passed: abort the request in the scheduler and answer 504 now, whether or
        not the scheduler still answers (its later updates for this rid are ignored)."""
        if st.finished:
            return
        message = f"request timed out after {timeout:g}s (--request-timeout)"
        logger.warning("rid=%s %s", st.rid, message)
        try:
            self._send(AbortRequest(rid=st.rid, message=message), st.dp_rank)
        except ServiceUnavailable:
            pass
        self._finish(st, {"type": "abort", "message": message}, 504)

    async def wait(self, states: list[ReqState], notify: asyncio.Event) -> None:
        """Return when something changed in one of the states (or at once when all are finished)."""
        if all(s.finished for s in states):
            return
        await notify.wait()
        notify.clear()

    def abort(self, rid: str, message: str = "aborted by client") -> bool:
        st = self.states.get(rid)
        if st is None:
            self._early_aborts[rid] = (time.monotonic(), message)
            self._early_aborts.move_to_end(rid)
            while len(self._early_aborts) > EARLY_ABORTS_MAX:
                self._early_aborts.popitem(last=False)
            return False
        if st.finished:
            return False
        try:
            self._send(AbortRequest(rid=rid, message=message), st.dp_rank)
        except ServiceUnavailable:
            self._finish(st, {"type": "abort", "message": message})
        return True

    def _take_early_abort(self, rids: list[str]) -> str | None:
        """The message of an abort that came for one of `rids` within EARLY_ABORT_TTL before it (taken)."""
        now = time.monotonic()
        while self._early_aborts:
            rid, (when, _) = next(iter(self._early_aborts.items()))
            if now - when <= EARLY_ABORT_TTL:
                break
            del self._early_aborts[rid]
        found = None
        for rid in rids:
            hit = self._early_aborts.pop(rid, None)
            if hit is not None:
                found = hit[1]
        if found is not None:
            self.early_aborts_applied += 1
        return found

    def abort_all(self, message: str = "aborted by abort_all") -> int:
        return sum(self.abort(rid, message) for rid in list(self.states))

    def release(self, st: ReqState, status: int) -> None:
        """The HTTP side is done with this request: abort it if unfinished, count it, log one line."""
        if st.released:
            return
        st.released = True
        if st.deadline is not None:
            st.deadline.cancel()
        if not st.finished:
            try:
                self._send(AbortRequest(rid=st.rid, message="client disconnected"), st.dp_rank)
            except ServiceUnavailable:
                pass
            self._finish(st, {"type": "abort", "message": "client disconnected"})
            status = 499
        self._unregister(st)
        self.pending.discard(st.rid)
        m = self.metrics
        m.requests.inc(endpoint=st.endpoint, status=str(status))
        m.prompt_tokens.inc(st.prompt_tokens)
        m.generation_tokens.inc(st.completion_tokens)
        m.cached_tokens.inc(st.cached_tokens)
        if st.finish_reason and st.finish_reason.get("type") == "abort":
            m.aborted.inc()
        elif status < 400:
            m.e2e.observe(st.e2e_latency)
            if st.first_token_time is not None and st.completion_tokens > 1:
                decode_time = (st.finished_time or time.time()) - st.first_token_time
                m.tpot.observe(decode_time / (st.completion_tokens - 1))
        fr = st.finish_reason or {}
        if st.span is not None:
            self.tracer.end(st.span, {"http.response.status_code": status, "pdserve.prompt_tokens": st.prompt_tokens,
                                      "pdserve.completion_tokens": st.completion_tokens},
                            error=fr.get("message") if status >= 400 else None)
        logger.info("rid=%s endpoint=%s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                    "latency=%.3fs finish=%s", st.rid, st.endpoint, status, st.prompt_tokens,
                    st.completion_tokens, st.cached_tokens, st.e2e_latency, fr.get("type"))

    # ------------------------------------------------------------------ queries
    async def _query(self, msg_type, timeout: float) -> list[dict[str, Any]]:
        """Every DP group's answer to one query, in rank order."""
        loop = asyncio.get_running_loop()
        qids = [next(self._qids) for _ in self._pushes]
        futs = [loop.create_future() for _ in qids]
        self._queries.update(zip(qids, futs, strict=True))
        try:
            for rank, qid in enumerate(qids):
                self._send(msg_type(qid=qid), rank)
            return list(await asyncio.wait_for(asyncio.gather(*futs), timeout))
        except TimeoutError:
            late = [rank for rank, f in enumerate(futs) if not f.done()]
            who = "the scheduler" if len(futs) == 1 else f"DP group(s) {late}"
            raise ServiceUnavailable(f"{who} did not answer within {timeout:.0f}s") from None
        finally:
            for qid in qids:
                self._queries.pop(qid, None)

    async def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        stats = merge_stats(await self._query(StatsQuery, timeout))
        self.metrics.set_stats(stats)
        return stats

    async def flush_cache(self, timeout: float = 30.0) -> dict[str, Any]:
        """Flush every group's prefix cache; `flushed` only when each one did."""
        answers = await self._query(FlushCacheRequest, timeout)
        return {**merge_stats(answers), "flushed": all(a.get("flushed", True) for a in answers)}

    # ------------------------------------------------------------------ output helpers
    def token_texts(self, ids: list[int]) -> list[str]:
        """Text of each token on its own (cached: logprob answers repeat them chunk after chunk)."""
        cache = self._token_text_cache
        missing = [t for t in dict.fromkeys(ids) if t not in cache]
        if missing:
            cache.update(zip(missing, token_texts(self.tokenizer, missing), strict=True))
        return [cache[t] for t in ids]
