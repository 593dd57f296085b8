"""Every field a client of OpenAI's, SGLang's or vLLM's generation APIs may send, and what this server does
with it. `docs/api_fields.md` is this table as a document (`python -m common.api_fields` writes it).

A request body is screened (`screen`) before it is decoded into its struct (common/protocol.py), on the
router and on the node alike:

* a field whose value is null counts as left out, as in all three APIs;
* a field of the struct is *implemented*: decoded and honoured;
* a field of a table below is *accepted* when its value asks for nothing this server would do otherwise
  (`best_of` equal to `n`, `lora_path` null, `store`, `metadata`, ...) and then dropped; any other value
  is *refused*: a 400 naming the field, the value and why (code `unsupported_value`);
* an *alias* is renamed to the field it means (`sampling_seed` is `seed`); both, unequal, is a 400;
* any other field is a 400 naming it (code `unknown_parameter`): nothing is ever dropped unread.

Nested objects (`sampling_params`, `stream_options`, `response_format`, `messages`, `tools`, ...) follow
the same rule in scopes of their own. `tests/unit/test_api_fields.py` derives OpenAI's field list from the
installed `openai` package, so a field a new SDK sends fails the suite before it surprises a user.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from common.protocol import (
    BadRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    JsonSchemaFormat,
    ResponseFormat,
    SamplingParams,
    StreamOptions,
    StructuredOutputs,
    convert,
    decode_json,
)


@dataclass(frozen=True)
class Rule:
    """A field this server does not decode: the values that ask for nothing here (`accepts(value,
    request)`, `request` the whole body), shown in the docs as `shown`, and why."""

    accepts: Callable[[Any, dict], bool]
    shown: str
    why: str
    source: str  # the APIs that define it
    alias: str | None = None  # the implemented field it means
    default: Any = None  # the one value an `only` rule accepts

    @property
    def kind(self) -> str:
        return "alias" if self.alias else "accepted" if self.shown == "any" else "refused"


def json_value(v: Any) -> str:
    return msgspec.json.encode(v).decode()


def inert(source: str, why: str) -> Rule:
    """Accepted whatever its value: it changes nothing in the answer here."""
    return Rule(lambda v, req: True, "any", why, source)


def only(value: Any, source: str, why: str) -> Rule:
    """Accepted at `value` (its default, which asks for nothing); refused otherwise."""
    return Rule(lambda v, req: v == value and type(v) is type(value), json_value(value),
                why, source, default=value)


def refused(source: str, why: str) -> Rule:
    """Accepted only as null (left out)."""
    return Rule(lambda v, req: False, "null", why, source)


def alias(target: str, source: str) -> Rule:
    return Rule(lambda v, req: True, "any", f"the same as `{target}`", source, alias=target)


OA, SG, VL = "OpenAI", "SGLang", "vLLM"
OA_SG, SG_VL, ALL = "OpenAI, SGLang", "SGLang, vLLM", "OpenAI, SGLang, vLLM"

TEXT_ONLY = "the models served here read text only"
NO_LORA = "LoRA adapters are not served"
NO_SESSIONS = "sessions (requests that continue a kept one) are not served"
NO_PROCESSORS = "custom logit processors are not run (they are code or parameters for code the client names)"
NO_TENANTS = ("the prefix cache has no per-tenant namespaces, so a keyed request would share cached prefixes "
              "with every other")
NO_MOE = ("the experts each token was routed to are not recorded per request (a node counts its per-expert "
          "loads: /server_info, /metrics)")
NOT_RETURNED = "this extra output is not computed"
NO_WATERMARK = "no watermark is applied"
NO_BEAM = "beam search is not run"
SGLANG_INTERNAL = "set inside SGLang's own processes; a client never sends it"
CACHE_AUTOMATIC = ("the prefix cache is automatic: every request reuses every cached prefix, with no key or "
                   "breakpoint")


def _best_of(v, req) -> bool:
    return v == (req.get("n") if req.get("n") is not None else 1)


def _text_modalities(v, req) -> bool:
    return v == ["text"]


def _empty_list(v, req) -> bool:
    return v == []


def _strict_function(v, req) -> bool:
    choice = req.get("tool_choice")
    return v is False or choice == "required" or isinstance(choice, dict)


# ---------------------------------------------------------------------------------------------- tables
MULTIMODAL = {name: refused(SG, TEXT_ONLY) for name in (
    "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "video_config", "modalities",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
    "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
    "positional_embed_overrides")}

GENERATE = {
    **MULTIMODAL,
    "use_audio_in_video": only(False, SG, TEXT_ONLY),
    "session_id": refused(SG, NO_SESSIONS),
    "session_params": refused(SG, NO_SESSIONS),
    "input_embeds": refused(SG, "prompts are text or token ids, not embeddings"),
    "watermark": refused(SG, NO_WATERMARK),
    "token_ids_logprob": refused(SG,
                                 "the logprobs of named token ids are not computed; use `top_logprobs_num`"),
    "return_sampling_mask": only(False, SG, NOT_RETURNED),
    "sampling_logprobs_mode": refused(SG, "logprobs are those of the model's distribution, in one mode"),
    "return_flat_raw_top_logprobs": only(False, SG, NOT_RETURNED),
    "return_flat_raw_output_top_logprobs": only(False, SG, NOT_RETURNED),
    "return_flat_raw_top_logprobs_b64": only(False, SG, NOT_RETURNED),
    "log_metrics": only(True, SG, "every request is counted in the metrics"),
    "return_hidden_states": only(False, SG, "hidden states are not returned"),
    "return_routed_experts": only(False, SG, NO_MOE),
    "routed_experts_start_len": only(0, SG, NO_MOE),
    "return_indexer_topk": only(False, SG, NOT_RETURNED),
    "lora_path": refused(SG, NO_LORA),
    "lora_id": refused(SG, NO_LORA),
    "custom_logit_processor": refused(SG, NO_PROCESSORS),
    "bootstrap_pair_key": refused(SG, "the PD rendezvous is bootstrap_host, bootstrap_port and "
                                      "bootstrap_room alone"),
    "decode_tp_size": inert(SG, "each node learns its peer's TP size in the transfer handshake"),
    "routed_dp_rank": alias("data_parallel_rank", SG),
    "disagg_prefill_dp_rank": refused(SG, "the prefill node's DP group is bootstrap_room mod its --dp-size, "
                                         "which both nodes derive"),
    "routing_key": inert(SG, "a hint for SGLang's gateway; this router chooses workers by its own policies"),
    "conversation_id": inert(SG, "an id for the client's own records"),
    "http_worker_ipc": refused(SG, SGLANG_INTERNAL),
    "background": only(False, SG, "background requests are not served"),
    "require_reasoning": only(False, SG,
                              "reasoning is not forced: the answer is what the chat template asks for"),
    "max_thinking_tokens": refused(SG, "no reasoning budget is enforced"),
    "extra_key": refused(SG, NO_TENANTS),
    "cache_salt": refused(SG_VL, NO_TENANTS),
    "no_logs": inert(SG, "the server never logs a request's text or tokens, only its id and counts"),
    "custom_labels": inert(SG, "per-request metric labels; the metrics here carry none"),
    "return_bytes": only(False, SG, NOT_RETURNED),
    "return_entropy": only(False, SG, NOT_RETURNED),
    "return_prompt_token_ids": only(False, SG, NOT_RETURNED),
    "external_trace_header": inert(SG, "trace context reaches this server in the W3C traceparent header"),
    "received_time": inert(SG, "SGLang's HTTP server stamps it; each node times requests itself"),
    "multi_item_delimiter_indices": refused(SG, "multi-item scoring is not served"),
    "token_indices_to_pool": refused(SG, "embeddings are not served"),
    "kv_hints": refused(SG, "KV placement hints are not read"),
}

SAMPLING = {
    "beam_width": only(1, SG, NO_BEAM),
    "structural_tag": refused(SG, "structural tags are not supported: use json_schema, regex or ebnf"),
    "stream_interval": inert(SG_VL, "it sets only how many tokens a stream event carries"),
    "sampling_seed": alias("seed", SG),
    "custom_params": refused(SG, NO_PROCESSORS),
    "watermark": refused(SG, NO_WATERMARK),
    **{name: refused(SG, SGLANG_INTERNAL) for name in ("stop_strs", "stop_regex_strs")},
    "stop_str_max_len": only(0, SG, SGLANG_INTERNAL),
    "stop_regex_max_len": only(0, SG, SGLANG_INTERNAL),
    "is_normalized": only(False, SG, SGLANG_INTERNAL),
    "ebnf_full_assistant": only(False, SG, SGLANG_INTERNAL),
}

# fields of both OpenAI-style endpoints (SGLang's and vLLM's extensions included)
OPENAI_COMMON = {
    "routed_dp_rank": alias("data_parallel_rank", SG),
    "disagg_prefill_dp_rank": GENERATE["disagg_prefill_dp_rank"],
    "return_hidden_states": GENERATE["return_hidden_states"],
    "return_routed_experts": GENERATE["return_routed_experts"],
    "routed_experts_start_len": GENERATE["routed_experts_start_len"],
    "return_cached_tokens_details": only(False, SG, NOT_RETURNED),
    "return_spec_tokens_details": only(False, SG, NOT_RETURNED),
    "return_token_ids": only(False, SG_VL, NOT_RETURNED),
    "lora_path": refused(SG, NO_LORA),
    "session_id": refused(SG_VL, NO_SESSIONS),
    "session_params": refused(SG, NO_SESSIONS),
    "custom_params": refused(SG, NO_PROCESSORS),
    "custom_logit_processor": refused(SG, NO_PROCESSORS),
    "watermark": refused(SG, NO_WATERMARK),
    "images_config": refused(SG, TEXT_ONLY),
    "mm_processor_kwargs": refused(SG_VL, TEXT_ONLY),
    "extra_key": refused(SG, NO_TENANTS),
    "cache_salt": refused(SG_VL, NO_TENANTS),
    "custom_labels": GENERATE["custom_labels"],
    "use_beam_search": only(False, VL, NO_BEAM),
    "watermarking": only(False, VL, NO_WATERMARK),
    "length_penalty": inert(VL, "it weighs beam-search candidates, and no beam search runs (as in vLLM "
                                "without it)"),
    "include_stop_str_in_output": alias("no_stop_trim", VL),
    "allowed_token_ids": refused(VL, "the vocabulary is not restricted; use `logit_bias`"),
    "prompt_logprobs": refused(VL, "use `echo` with `logprobs` on /v1/completions (or SGLang's "
                                  "`logprob_start_len` on /generate) for the prompt's logprobs"),
    "logprob_token_ids": refused(VL, "the logprobs of named token ids are not computed; use `top_logprobs`"),
    "bad_words": Rule(_empty_list, "[]", "no word is banned from the output; use `logit_bias`", VL),
    "prompt_embeds": refused(VL, "prompts are text or token ids, not embeddings"),
    "request_id": inert(VL, "the request's id in logs is `rid` or the X-Request-ID header"),
    "routed_experts_prompt_start": only(0, VL, NO_MOE),
    "return_token_offsets": only(False, VL, NOT_RETURNED),
    "mm_payload": refused(VL, TEXT_ONLY),
    "return_mm_kwargs": only(False, VL, TEXT_ONLY),
    "kv_transfer_params": refused(VL, "vLLM's own disaggregation parameters; this cluster's router sets the "
                                     "rendezvous (bootstrap_host, bootstrap_port, bootstrap_room)"),
    "ec_transfer_params": refused(VL, TEXT_ONLY),
    "vllm_xargs": refused(VL, "vLLM's extension arguments name vLLM plug-ins"),
    "repetition_detection": refused(VL,
                                    "repetitions do not stop a request; use `stop` or `frequency_penalty`"),
    "thinking_token_budget": refused(VL, "no reasoning budget is enforced"),
    "stream_interval": SAMPLING["stream_interval"],
}

COMPLETIONS = {
    **OPENAI_COMMON,
    "best_of": Rule(_best_of, "null or equal to n", "only the `n` answers asked for are generated", ALL),
    "add_special_tokens": only(True, VL, "a prompt is always tokenized with the tokenizer's special tokens"),
}

CHAT = {
    **OPENAI_COMMON,
    "audio": refused(OA, TEXT_ONLY + " and write text only"),
    "function_call": refused(OA, "deprecated by OpenAI in favour of `tool_choice`, which is served"),
    "functions": refused(OA, "deprecated by OpenAI in favour of `tools`, which are served"),
    "metadata": inert(OA, "tags for stored completions; nothing is stored here"),
    "store": inert(OA, "nothing is stored here: the answer is returned and forgotten"),
    "modalities": Rule(_text_modalities, '["text"]', TEXT_ONLY + " and write text only", OA),
    "moderation": refused(OA, "no moderation model runs here"),
    "prediction": inert(OA, "a predicted output only speeds up OpenAI's answer; the answer is the same "
                            "without it"),
    "prompt_cache_key": inert(OA, CACHE_AUTOMATIC),
    "prompt_cache_options": inert(OA, CACHE_AUTOMATIC),
    "prompt_cache_retention": inert(OA, CACHE_AUTOMATIC),
    "safety_identifier": inert(OA, "an end-user id for OpenAI's abuse checks; logged with the request's rid"),
    "service_tier": inert(OA, "there is one tier here"),
    "verbosity": refused(OA, "no model served here reads a verbosity"),
    "web_search_options": refused(OA, "no web search runs here"),
    "return_prompt_token_ids": GENERATE["return_prompt_token_ids"],
    "return_meta_info": only(False, SG, NOT_RETURNED),
    "return_input_ids_in_sglext": only(False, SG, NOT_RETURNED),
    "return_output_ids_in_sglext": only(False, SG, NOT_RETURNED),
    "return_sampling_mask": GENERATE["return_sampling_mask"],
    "sampling_logprobs_mode": GENERATE["sampling_logprobs_mode"],
    "return_flat_raw_output_top_logprobs": GENERATE["return_flat_raw_output_top_logprobs"],
    "return_flat_raw_top_logprobs_b64": GENERATE["return_flat_raw_top_logprobs_b64"],
    "task": refused(SG, "DeepSeek-V4's quick-instruction tasks are not served"),
    "max_dynamic_patch": refused(SG, TEXT_ONLY),
    "min_dynamic_patch": refused(SG, TEXT_ONLY),
    "use_audio_in_video": only(False, SG, TEXT_ONLY),
    "video_config": refused(SG, TEXT_ONLY),
    "media_io_kwargs": refused(VL, TEXT_ONLY),
    "input_ids": refused(SG, "a chat request's prompt is its `messages`; send token ids to /v1/completions"),
    "include_reasoning": only(True, VL, "reasoning is not split from the answer: it stays in `content`"),
    "echo": only(False, VL, "a chat answer does not repeat the last message"),
    "add_special_tokens": only(False, VL, "the chat template writes the special tokens itself"),
    "chat_template": refused(VL, "a node's chat template is fixed when it starts (--chat-template): a "
                                "client's template would run on the server"),
    "return_prompt_text": only(False, VL, NOT_RETURNED),
}

STREAM_OPTIONS = {
    "include_obfuscation": inert(OA, "obfuscation pads OpenAI's stream events against a traffic side "
                                    "channel; the events here carry no padding either way"),
}

MESSAGE = {
    "audio": refused(OA, "earlier audio answers cannot be replayed: " + TEXT_ONLY),
    "function_call": refused(OA, "deprecated by OpenAI in favour of `tool_calls`, which are served"),
    "thinking": alias("reasoning_content", VL),
    "reasoning": alias("reasoning_content", VL),
    "phase": refused(SG, "message phases (commentary, final answer) are not rendered"),
    "tools": refused(SG, "tools are given once, in the request's `tools`"),
    "prefix": refused(SG,
                      "use the request's `continue_final_message` to continue the last assistant message"),
}

CONTENT_PART = {
    "image_url": refused(OA_SG, TEXT_ONLY),
    "input_audio": refused(OA, TEXT_ONLY),
    "file": refused(OA, TEXT_ONLY),
    "video_url": refused(SG, TEXT_ONLY),
    "audio_url": refused(SG, TEXT_ONLY),
    "prompt_cache_breakpoint": inert(OA, CACHE_AUTOMATIC),
}

TOOL = {
    "custom": refused(OA, "custom (free-form) tools are not served; give function tools"),
    "defer_loading": only(False, SG, "every tool is shown to the model with the request"),
}

FUNCTION = {
    "strict": Rule(_strict_function, "false, or any with tool_choice required or a named function",
                   "a forced call (tool_choice required or named) always follows the schema; with "
                   "tool_choice auto the model's calls are parsed as written, so a strict one cannot be "
                   "promised", OA),
    "defer_loading": TOOL["defer_loading"],
    "key_order": inert(SG, "SGLang keeps the client's key order of a tool; here the tool goes to the "
                          "template as sent"),
}

RESPONSE_FORMAT = {
    name: refused(SG, "structural tags are not supported: use json_schema") for name in
    ("structures", "triggers", "at_least_one", "format")
}

STRUCTURED_OUTPUTS = {
    "disable_any_whitespace": only(False, VL, "the JSON grammar allows the whitespace JSON allows"),
    "disable_additional_properties": only(False, VL, "a schema's own additionalProperties decides"),
    "whitespace_pattern": refused(VL, "the JSON grammar allows the whitespace JSON allows"),
    "structural_tag": SAMPLING["structural_tag"],
}


# ---------------------------------------------------------------------------------------------- scopes
@dataclass(frozen=True)
class Scope:
    implemented: frozenset[str]
    rules: dict[str, Rule]
    nested: dict[str, str]  # field -> the scope of its object (or of each object of its list)


def _fields(struct: type) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(struct))


SCOPES: dict[str, Scope] = {
    "generate": Scope(_fields(GenerateRequest), GENERATE, {"sampling_params": "sampling_params"}),
    "sampling_params": Scope(_fields(SamplingParams), SAMPLING, {}),
    "completions": Scope(_fields(CompletionRequest), COMPLETIONS,
                         {"stream_options": "stream_options", "response_format": "response_format",
                          "structured_outputs": "structured_outputs"}),
    "chat": Scope(_fields(ChatCompletionRequest), CHAT,
                  {"messages": "message", "tools": "tool", "stream_options": "stream_options",
                   "response_format": "response_format", "structured_outputs": "structured_outputs"}),
    "stream_options": Scope(_fields(StreamOptions), STREAM_OPTIONS, {}),
    "response_format": Scope(_fields(ResponseFormat), RESPONSE_FORMAT, {"json_schema": "json_schema"}),
    "json_schema": Scope(_fields(JsonSchemaFormat), {}, {}),
    "structured_outputs": Scope(_fields(StructuredOutputs), STRUCTURED_OUTPUTS, {}),
    "message": Scope(_fields(ChatMessage), MESSAGE, {"content": "content_part"}),
    "content_part": Scope(frozenset({"type", "text", "refusal"}), CONTENT_PART, {}),
    "tool": Scope(frozenset({"type", "function"}), TOOL, {"function": "function"}),
    "function": Scope(frozenset({"name", "description", "parameters"}), FUNCTION, {}),
}
SCOPE_OF = {GenerateRequest: "generate", CompletionRequest: "completions", ChatCompletionRequest: "chat"}


def known_fields(scope: str) -> set[str]:
    """Every field name the scope implements or has a rule for."""
    s = SCOPES[scope]
    return set(s.implemented) | set(s.rules)


def _shown(value: Any) -> str:
    text = msgspec.json.encode(value).decode() if not isinstance(value, str) else repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def screen(obj: dict, scope: str, where: str = "", root: dict | None = None) -> dict:
    """`obj` (a request body, or an object nested in one at `where`) as its struct decodes it: nulls left
    out, accepted fields dropped, aliases renamed; raises BadRequest naming the field otherwise."""
    s = SCOPES[scope]
    root = obj if root is None else root
    out: dict = {}
    for name, value in obj.items():
        if value is None:
            continue
        path = f"{where}.{name}" if where else name
        rule = s.rules.get(name)
        if rule is not None:
            if rule.alias is not None:
                target = rule.alias
                given = obj.get(target)
                if given is not None and given != value:
                    raise BadRequest(f"`{path}` and `{target}` are the same field, given different values")
                out[target] = value
            elif not rule.accepts(value, root):
                raise BadRequest(f"`{path}` = {_shown(value)} is not supported by this server: {rule.why} "
                                 f"(accepted: {rule.shown})")
            continue
        if name not in s.implemented:
            raise BadRequest(f"`{path}` is not a field this server knows or supports")
        inner = s.nested.get(name)
        if inner is not None:
            value = _screen_nested(value, inner, path, root)
        if name not in out:  # an alias given before it holds the same value
            out[name] = value
    return out


def _screen_nested(value: Any, scope: str, path: str, root: dict) -> Any:
    if isinstance(value, dict):
        return screen(value, scope, path, root)
    if isinstance(value, list):
        return [screen(v, scope, f"{path}[{i}]", root) if isinstance(v, dict) else v
                for i, v in enumerate(value)]
    return value  # not an object: the struct's own type check names it


def decode_request(body: bytes, type_: type) -> tuple[dict, Any]:
    """A generation endpoint's body as the client sent it (the router forwards it) and as `type_` decodes it
    after screening; BadRequest names the field."""
    obj = decode_json(body, Any)
    if not isinstance(obj, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number",
                float: "number"}.get(type(obj), "null")
        raise BadRequest(f"request body must be a JSON object: Expected `object`, got `{kind}` - at `$`")
    return obj, convert(screen(obj, SCOPE_OF[type_]), type_, "")


# ---------------------------------------------------------------------------------------------- the document
def markdown() -> str:
    """docs/api_fields.md: every field not implemented as such, with what is accepted and why."""
    lines = ["# Request fields", "",
             "Generated by `python -m common.api_fields` from `common/api_fields.py`; do not edit "
             "by hand.", "",
             "The generation endpoints (`/generate`, `/v1/completions`, `/v1/chat/completions`) take the "
             "fields of SGLang's, OpenAI's and vLLM's request types. Every field is one of:", "",
             "* **implemented** — listed under each scope below, and honoured;",
             "* **accepted** — it changes nothing in the answer here, so any value is taken;",
             "* **refused** unless it has the value shown (its default, which asks for nothing) — any other "
             "value is a 400 naming the field and saying why (`code: unsupported_value`);",
             "* an **alias** of an implemented field.", "",
             "A null value counts as the field left out. Any field not listed is a 400 "
             "(`code: unknown_parameter`), never dropped.", ""]
    for name, s in SCOPES.items():
        lines += [f"## `{name}`", "",
                  "Implemented: " + ", ".join(f"`{f}`" for f in sorted(s.implemented)) + ".", ""]
        if s.rules:
            lines += ["| field | defined by | kind | accepted values | why |", "|---|---|---|---|---|"]
            for field, r in sorted(s.rules.items()):
                lines.append(f"| `{field}` | {r.source} | {r.kind} | {r.shown} | {r.why} |")
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
