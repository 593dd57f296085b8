"""Everything that crosses a wire, as msgspec structs.

* HTTP bodies a node or the router accepts: SGLang's native `/generate` and OpenAI's
  `/v1/completions` and `/v1/chat/completions` (with SGLang's extension fields, including the
  bootstrap rendezvous a PD router injects).
* ZMQ messages between a node's HTTP front end and its scheduler (msgpack, tagged unions).
* The conventions a node and the router share: the error body (`error_body`, OpenAI's shape) and the
  request ids of a batch given one id (`item_rids`).

Validation errors name the field: `decode_json` turns msgspec's error into `BadRequest` whose
message starts with the JSON path (e.g. "`$.sampling_params.temperature` ...").
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Annotated, Any, Literal

import msgspec

# --------------------------------------------------------------------------------------------
# validation helpers


class BadRequest(ValueError):
    """Client input is invalid; the message names the field. Served as HTTP 400."""


class ModelNotFound(LookupError):
    """A request names a model this server does not serve: HTTP 404 with code `model_not_found`, as
    OpenAI's API and SGLang answer."""

    def __init__(self, model: str, served: str) -> None:
        shown = model if len(model) <= 128 else model[:128] + "..."
        super().__init__(f"the model `{shown}` does not exist here: this server serves `{served}` (GET "
                         "/v1/models)")


def decode_json(body: bytes, type_: type) -> Any:
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise BadRequest(validation_message(e)) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"malformed JSON: {e}") from None


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


def validation_message(e: msgspec.ValidationError, where: str = "") -> str:
    """msgspec's message with the JSON path of the bad field (it names it "... - at `$.x`", except for
    the body itself); an unknown field is named as a path of its own: requests are strict, a field this
    server does not know or support is refused rather than dropped."""
    message = str(e)
    m = _UNKNOWN.fullmatch(message)
    if m:
        path = ".".join(x for x in (where, m.group(2) or "", m.group(1)) if x)
        return f"`{path}` is not a field this server knows or supports"
    if where:
        return message.replace("- at `$", f"- at `{where}") if " - at `$" in message \
            else f"{message} - at `{where}`"
    if message.startswith("`"):  # our own check (`__post_init__`), naming its field
        return message.removesuffix(" - at `$`")
    return message if " - at `$" in message else f"request body: {message} - at `$`"


def convert(obj: Any, type_: type, where: str) -> Any:
    try:
        return msgspec.convert(obj, type=type_)
    except msgspec.ValidationError as e:
        raise BadRequest(validation_message(e, where)) from None


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "method_not_allowed", 413: "invalid_request_error",
                429: "rate_limit_error",
                499: "request_aborted", 500: "internal_error", 502: "upstream_error",
                503: "service_unavailable", 504: "upstream_error"}


# A node's error answer names a cause the router acts on in this header. `kv_transfer`: the KV transfer
# between the two nodes failed, which is the other node's or the network's doing as often as this one's,
# so the router retries but counts it against neither worker's circuit breaker (the node at fault fails
# its own leg and its health checks).
# `local_prefill_refused`: a decode node asked to prefill a request itself (no rendezvous) will not, as the
# prompt is over its --disaggregation-local-prefill-max-tokens: the router sends it again with both legs.
ERR_TYPE_HEADER = "X-PD-Error-Type"
KV_TRANSFER_FAILED = "kv_transfer"
LOCAL_PREFILL_REFUSED = "local_prefill_refused"
# the node is switching its role (a router sends the request to another pair: nothing reached the client)
ROLE_SWITCH = "role_switch"


_PATH = re.compile(r" - at `\$\.([^`]+)`")
_NAMED = re.compile(r"`\$?\.?([A-Za-z_][A-Za-z0-9_.\[\]]*)`")
_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 429: "rate_limit_exceeded"}


def error_param(message: str) -> str | None:
    """The request field an error message names (the JSON path msgspec gives, else the first
    `field` in backquotes), as OpenAI's `param`."""
    m = _PATH.search(message) or _NAMED.search(message)
    return m.group(1) if m else None


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """Every HTTP error of a node or the router, in OpenAI's shape: {"error": {message, type, param,
    code}}: `param` the field a 400 names, `code` a string (`invalid_value`, `unknown_parameter`,
    `context_length_exceeded`, `rate_limit_exceeded`, `model_not_found`, ...) or null, as OpenAI's API
    answers; `code` given wins."""
    type_ = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    param = error_param(message) if status == 400 else None
    if code is None:
        code = _code_of(status, message, param)
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _code_of(status: int, message: str, param: str | None) -> str | None:
    if status != 400:
        return _CODES.get(status)
    if "is not a field this server knows" in message:
        return "unknown_parameter"
    if "is not supported by this server" in message:
        return "unsupported_value"
    if "context length" in message or "context window" in message:
        return "context_length_exceeded"
    return "invalid_value" if param else "invalid_request"


# --------------------------------------------------------------------------------------------
# the PD rendezvous a router injects: one rule for the nodes and the router

MAX_BOOTSTRAP_ROOM = 2**63 - 1  # rooms travel as signed 64-bit integers (metadata rows, numpy)
MAX_HOST_LENGTH = 253  # a DNS name's limit (RFC 1123); an IPv6 literal in brackets is shorter
_HOST_CHARS = re.compile(r"[A-Za-z0-9.:%\[\]_-]+")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

BootstrapHost = Annotated[str, msgspec.Meta(
    min_length=1, max_length=MAX_HOST_LENGTH,
    description="prefill bootstrap server: a host name (RFC 1123) or an IPv4/IPv6 address, no "
                "scheme or port")]
BootstrapPort = Annotated[int, msgspec.Meta(ge=1, le=65535, description="prefill bootstrap port")]
BootstrapRoom = Annotated[int,
                          msgspec.Meta(ge=0, le=MAX_BOOTSTRAP_ROOM, description="rendezvous id, 0..2**63-1")]
# request ids are logged with every event of a request: bounded, and no control characters (C0, DEL, C1),
# so a rid cannot forge or break a log line. (The pattern stays within Latin-1: msgspec 0.22 crashes
# formatting the error of a pattern with other characters; `check_rid` refuses U+2028/U+2029.)
MAX_RID_LENGTH = 256
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_RID_LENGTH, pattern=r"^[^\x00-\x1f\x7f-\x9f]*$",
                                        description="request id: at most 256 characters, no control "
                                                    "characters")]

# scheduling priority (SGLang's `priority`): a larger value runs first (a smaller one with
# --schedule-low-priority-values-first), arrival order among equals, on every node; preemption and the
# full queue's order by it need --schedule-policy priority
MAX_PRIORITY = 2**31 - 1
Priority = Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                                       description="scheduling priority, -(2**31-1)..2**31-1")]
# the DP group of a node with --dp-size that runs the request (SGLang's field; a dp-aware router sets it)
DataParallelRank = Annotated[int,
                             msgspec.Meta(ge=0, le=1023, description="DP group of the node, 0..dp_size-1")]


def check_rid(rid: str, where: str = "rid") -> None:
    """What `RequestId` cannot say: no Unicode line or paragraph separator (Python's `splitlines` and
    some log viewers break lines there)."""
    if "\u2028" in rid or "\u2029" in rid:
        raise BadRequest(f"`{where}` must not contain a line or paragraph separator (U+2028/U+2029)")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def check_request_id(value: str, where: str = "X-Request-ID") -> str:
    """A client's request id (a header) held to the `RequestId` rule: it becomes the rid of every log line."""
    if not value or len(value) > MAX_RID_LENGTH or _CONTROL.search(value):
        raise BadRequest(f"`{where}` must have 1 to {MAX_RID_LENGTH} characters and no control characters")
    return value


def normalize_host(host: str, where: str = "bootstrap_host") -> str:
    """`host` as a peer address: a host name per RFC 1123 (labels of letters, digits and inner hyphens,
    at most 253 characters, not all-numeric at the end), an IPv4 address, or an IPv6 address (bare or in
    brackets; returned in brackets so `host:port` stays unambiguous). BadRequest names `where` otherwise.
    The range of ports and rooms is in the `BootstrapPort` / `BootstrapRoom` types."""
    if 0 < len(host) <= MAX_HOST_LENGTH and _HOST_CHARS.fullmatch(host):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ip = ipaddress.ip_address(inner)
        except ValueError:
            ip = None
        if isinstance(ip, ipaddress.IPv6Address):
            return f"[{ip.compressed}]"
        if ip is not None and inner == host:
            return host
        labels = host.split(".")
        if inner == host and all(_LABEL.fullmatch(x) for x in labels) and not labels[-1].isdigit():
            return host
    shown = host if len(host) <= 64 else host[:64] + "..."
    raise BadRequest(f"`{where}` must be a host name (RFC 1123) or an IPv4/IPv6 address, without scheme, "
                     f"port or spaces; got {shown!r}")


def normalize_hosts(value: str | list[str] | None, name: str = "bootstrap_host") -> str | list[str] | None:
    """`normalize_host` of a field that is one host or one per batch item (the index is named)."""
    if isinstance(value, list):
        return [normalize_host(h, f"{name}[{i}]") for i, h in enumerate(value)]
    return None if value is None else normalize_host(value, name)


# --------------------------------------------------------------------------------------------
# sampling parameters (SGLang's names)

# stop conditions are matched against every output token: bounded per request. OpenAI's own API takes at
# most 4 stop strings; SGLang and vLLM take any number, so the cap here is looser than OpenAI's
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256  # characters
MAX_STOP_TOKEN_IDS = 256

MAX_N = 64  # copies of one prompt (`n`); each is a request of its own in the queue
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` (OpenAI's own limit)
MAX_GRAMMAR_LENGTH = 65536  # characters of a json_schema / regex / ebnf


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # regular expressions (Python `re`) searched in the output text: a match ends the request as `stop`
    # does, the text cut before the match (kept with no_stop_trim)
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # token id (as a string, OpenAI's shape) -> value added to its logit, -100..100
    logit_bias: dict[str, float] | None = None
    # structured output: at most one of them; the output is constrained to the grammar (xgrammar)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def stop_regexes(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the request's grammar: kind is json_schema, regex or ebnf."""
        for kind in ("json_schema", "regex", "ebnf"):
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    def logit_bias_items(self) -> list[tuple[int, float]]:
        return [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]

    def verify(self, where: str = "sampling_params") -> None:
        """Raise BadRequest naming the field when a value is out of range."""

        def bad(field: str, why: str) -> BadRequest:
            return BadRequest(f"`{where}.{field}` {why}")

        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must be between 0 and max_new_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise bad(name, f"must be in [-2, 2], got {v}")
        if not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        self._verify_stops(bad)
        self._verify_logit_bias(bad)
        kinds = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise bad(kinds[1], f"cannot be combined with `{kinds[0]}`: give one grammar")
        for k in kinds:
            source = getattr(self, k)
            if not source or len(source) > MAX_GRAMMAR_LENGTH:
                raise bad(k, f"must have 1 to {MAX_GRAMMAR_LENGTH} characters, got {len(source)}")

    def _verify_stops(self, bad) -> None:
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad("stop", f"has {len(stops)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
        for i, s in enumerate(stops):
            name = "stop" if isinstance(self.stop, str) else f"stop[{i}]"
            if not s:
                raise bad(name, "must not be an empty string")
            if len(s) > MAX_STOP_STRING_LENGTH:
                raise bad(name,
                          f"has {len(s)} characters; a stop string has at most {MAX_STOP_STRING_LENGTH}")
        regexes = self.stop_regexes()
        if len(regexes) > MAX_STOP_STRINGS:
            raise bad("stop_regex", f"has {len(regexes)} patterns; at most {MAX_STOP_STRINGS} are allowed")
        for i, s in enumerate(regexes):
            name = "stop_regex" if isinstance(self.stop_regex, str) else f"stop_regex[{i}]"
            if not s or len(s) > MAX_STOP_STRING_LENGTH:
                raise bad(name, f"must have 1 to {MAX_STOP_STRING_LENGTH} characters")
            try:
                if re.compile(s).match(""):
                    raise bad(name, "matches the empty string, so it would stop every request at once")
            except re.error as e:
                raise bad(name, f"is not a valid regular expression: {e}") from None
        if self.stop_token_ids:
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise bad("stop_token_ids", f"has {len(self.stop_token_ids)} ids; at most "
                          f"{MAX_STOP_TOKEN_IDS} are allowed")
            if any(t < 0 for t in self.stop_token_ids):
                raise bad("stop_token_ids", "must be non-negative token ids")

    def _verify_logit_bias(self, bad) -> None:
        if not self.logit_bias:
            return
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias",
                      f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for k, v in self.logit_bias.items():
            if not k.isdigit() or len(k) > 9:
                raise bad(f"logit_bias.{k[:32]}",
                          "must be keyed by a token id (a non-negative integer as a string)")
            if not (math.isfinite(v) and -100 <= v <= 100):
                raise bad(f"logit_bias.{k}", f"must be a number in [-100, 100], got {v}")


# --------------------------------------------------------------------------------------------
# HTTP: SGLang native /generate


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """SGLang's GenerateReqInput: the fields this server honours (`common/api_fields.py` says what happens
    to the others)."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    model: str | None = None  # sglang-router sends it (null); one model is served
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    rid: RequestId | list[RequestId] | None = None
    bootstrap_host: BootstrapHost | list[BootstrapHost] | None = None
    bootstrap_port: BootstrapPort | list[BootstrapPort] | None = None
    bootstrap_room: BootstrapRoom | list[BootstrapRoom] | None = None
    priority: Priority | list[Priority] | None = None
    data_parallel_rank: DataParallelRank | None = None


def item_rids(rid: str, n: int) -> list[str]:
    """The request ids of the n items of a batch that was given one id. The router and the node derive
    the same ids, so an abort by item id reaches every item."""
    return [f"{rid}-{i}" for i in range(n)]


# --------------------------------------------------------------------------------------------
# HTTP: OpenAI compatible


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    include_usage: bool = False  # a last event with the usage of the whole request
    continuous_usage_stats: bool = False  # the usage so far in every event


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # an assistant turn's calls and a tool turn's answer to one of them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # an assistant turn that refused: its text, when it has no content


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any] | None = None  # none: any JSON value
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """vLLM's `structured_outputs`: one constraint on the answer."""

    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None  # the answer is one of these strings
    grammar: str | None = None  # EBNF
    json_object: bool | None = None


class _OpenAICommon(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """The fields of OpenAI's completion APIs this server honours, with SGLang's and vLLM's extensions
    (`common/api_fields.py` says what happens to the others)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None  # OpenAI's end-user id: logged with the request's rid
    logit_bias: dict[str, float] | None = None
    # SGLang extensions (None: left out, so the node's sampling defaults apply)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_regex: str | list[str] | None = None
    response_format: ResponseFormat | None = None
    json_schema: str | None = None  # SGLang's: the schema as text
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's: keep only the last k prompt tokens (-1: as many as the context leaves room for one output
    # token), or the first k with truncation_side "right"
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] = "left"
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens named "token_id:<id>"
    # a PD router sends one entry per item when the request has several (a list of prompts, or n > 1)
    rid: RequestId | list[RequestId] | None = None
    bootstrap_host: BootstrapHost | list[BootstrapHost] | None = None
    bootstrap_port: BootstrapPort | list[BootstrapPort] | None = None
    bootstrap_room: BootstrapRoom | list[BootstrapRoom] | None = None
    priority: Priority | None = None
    data_parallel_rank: DataParallelRank | None = None


class CompletionRequest(_OpenAICommon, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_OpenAICommon, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # handed to the chat template when it reads them (a 400 otherwise): OpenAI's reasoning_effort,
    # SGLang's thinking configuration, vLLM's documents (retrieval-augmented templates)
    reasoning_effort: Annotated[str, msgspec.Meta(pattern=r"^[a-z_]{1,32}$")] | None = None
    thinking: Any = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # vLLM's: false ends the prompt after the last message
    # the last message is the start of the answer: the template continues it (no new turn)
    continue_final_message: bool = False
    # SGLang splits reasoning out of answers only with a reasoning parser, which this server does not
    # have: either value gives the same answer (sglang-router sends both as true)
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class AbortHTTPRequest(msgspec.Struct):
    rid: RequestId = ""
    abort_all: bool = False


# --------------------------------------------------------------------------------------------
# ZMQ: front end <-> scheduler (msgpack)


class TokenizedRequest(msgspec.Struct, tag=True, omit_defaults=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    # the items of one HTTP request are sent one after the other; the scheduler admits them together
    # (--max-queued-requests): the first item carries the batch's size, the others their index
    batch_size: int = 1
    batch_index: int = 0
    traceparent: str | None = None  # W3C trace context of the front end's span (--enable-trace)
    data_parallel_rank: int | None = None  # the DP group it must run on (None: the front end chooses)


class AbortRequest(msgspec.Struct, tag=True):
    rid: str
    message: str = "aborted by client"


class StatsQuery(msgspec.Struct, tag=True):
    qid: int


class FlushCacheRequest(msgspec.Struct, tag=True):
    qid: int


class Wake(msgspec.Struct, tag=True):
    """Nothing to do: under DP attention the front end sends it to the other groups with each request, so
    an idle group's loop comes at once to the step agreement its busy peer waits at."""


class SwitchRole(msgspec.Struct, tag=True):
    """Drain, then serve `role` ("prefill" or "decode") with the weights loaded
    (common/scheduler/role_switch.py); the answer is a StatsReport once the group serves it, or says why
    not. Requests still open after `drain_timeout` seconds are ended with a 503 the router retries."""

    qid: int
    role: str
    drain_timeout: float


ToScheduler = TokenizedRequest | AbortRequest | StatsQuery | FlushCacheRequest | Wake | SwitchRole


class ReqUpdate(msgspec.Struct, omit_defaults=True):
    """What a request produced since its previous update."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # None while running; else SGLang's shape: {"type": "stop"|"length"|"abort", ...}
    finish_reason: dict[str, Any] | None = None
    # each entry [logprob, token_id]; top entries a list of [logprob, token_id] per position
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    error_status: int = 0  # HTTP status to answer with when the request failed (0 = ok)


class BatchOut(msgspec.Struct, tag=True):
    updates: list[ReqUpdate]
    # rids the scheduler took in since its previous message (its queue had room): the front end counts
    # what is still in its pipe by them, and starts a stream's answer once its requests are admitted
    admitted: list[str] = []


class StatsReport(msgspec.Struct, tag=True):
    qid: int
    stats: dict[str, Any]


FromScheduler = BatchOut | StatsReport
