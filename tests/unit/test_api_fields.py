"""The field table (common/api_fields.py): OpenAI's request fields as the installed `openai` package
declares them, every one known to the table (a field a new SDK sends fails here first); the table's
own consistency (every rule's accepted value passes, every refused field names itself and says why);
the screening rules on bodies (nulls, aliases, nested objects); and docs/api_fields.md as generated."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import typing_extensions
from openai.types import completion_create_params as completions_params
from openai.types.chat import completion_create_params as chat_params

from common.api_fields import SCOPE_OF, SCOPES, decode_request, known_fields, markdown, screen
from common.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest, error_body

ROOT = Path(__file__).resolve().parents[2]
# implemented fields whose objects are read as a whole by their handler, not screened field by field:
# `tool_choice` (tool_calls.plan_tools names what it does not take) and an earlier answer's `tool_calls`
# (handed to the chat template as given)
WHOLE = {("chat", "tool_choice"), ("message", "tool_calls")}


def _typed_dicts(tp) -> list[type]:
    """The TypedDict classes an annotation names (through Union, Optional, Iterable, Required, ...)."""
    if typing_extensions.is_typeddict(tp):  # the SDK builds its TypedDicts with typing_extensions
        return [tp]
    out = []
    for arg in typing.get_args(tp):
        out += _typed_dicts(arg)
    return out


def _keys(td: type) -> set[str]:
    return set(td.__required_keys__) | set(td.__optional_keys__)


def _walk(scope: str, td: type, where: str, seen: set) -> list[str]:
    """Problems with OpenAI's `td` against `scope`: fields the table does not know, and nested objects
    of implemented fields that no scope screens."""
    if (scope, td) in seen:
        return []
    seen.add((scope, td))
    s = SCOPES[scope]
    problems = []
    hints = typing.get_type_hints(td)
    for key in sorted(_keys(td)):
        path = f"{where}.{key}"
        if key not in known_fields(scope):
            problems.append(f"{path} ({td.__name__}) is not in scope {scope!r}")
            continue
        if key not in s.implemented:
            continue  # accepted or refused as a whole
        inner = _typed_dicts(hints[key])
        if not inner:
            continue
        child = s.nested.get(key)
        if child is None:
            if (scope, key) not in WHOLE:
                problems.append(f"{path} holds objects ({', '.join(t.__name__ for t in inner)}) no "
                                "scope screens")
            continue
        for t in inner:
            problems += _walk(child, t, path, seen)
    return problems


def test_every_openai_field_is_in_the_table():
    seen: set = set()
    problems = []
    for scope, module in (("completions", completions_params), ("chat", chat_params)):
        for cls in (module.CompletionCreateParamsNonStreaming, module.CompletionCreateParamsStreaming):
            problems += _walk(scope, cls, scope, seen)
    assert not problems, "\n".join(problems)
    assert len(seen) > 15  # messages, content parts, tools, response formats, stream options were all walked


def test_every_rule_is_consistent():
    for name, s in SCOPES.items():
        assert not set(s.rules) & s.implemented, name
        assert set(s.nested) <= s.implemented, name
        for field, rule in s.rules.items():
            assert rule.why and rule.source, (name, field)
            if rule.alias is not None:
                assert rule.alias in s.implemented, (name, field)


CUSTOM = {"best_of", "modalities", "bad_words", "strict"}  # rules with a test of their own below


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_rules_accept_their_value_and_refuse_others_by_name(scope):
    for field, rule in SCOPES[scope].rules.items():
        if rule.alias or field in CUSTOM:
            continue
        assert screen({field: None}, scope, "x") == {}, (scope, field)  # null: left out
        if rule.kind == "accepted":
            assert screen({field: {"any": "value"}}, scope, "x") == {}, (scope, field)
            continue
        if rule.shown != "null":
            assert screen({field: rule.default}, scope, "x") == {}, (scope, field)
        with pytest.raises(BadRequest) as e:
            screen({field: "not-the-default"}, scope, "x")
        message = str(e.value)
        assert message.startswith(f"`x.{field}` = 'not-the-default' is not supported") and rule.why in message
        assert error_body(400, message)["error"]["code"] == "unsupported_value"


def test_custom_rules():
    assert screen({"best_of": 1}, "completions") == {}
    assert screen({"best_of": 3, "n": 3}, "completions") == {"n": 3}
    with pytest.raises(BadRequest, match=r"`best_of` = 2 .* only the `n` answers"):
        screen({"best_of": 2}, "completions")
    assert screen({"modalities": ["text"]}, "chat") == {}
    with pytest.raises(BadRequest, match="modalities"):
        screen({"modalities": ["text", "audio"]}, "chat")
    assert screen({"bad_words": []}, "completions") == {}
    with pytest.raises(BadRequest, match="bad_words"):
        screen({"bad_words": ["x"]}, "completions")
    tool = {"type": "function", "function": {"name": "f", "strict": True}}
    assert screen({"tools": [tool],
                   "tool_choice": "required"}, "chat")["tools"][0]["function"] == {"name": "f"}
    with pytest.raises(BadRequest, match=r"`tools\[0\].function.strict` = true .* tool_choice auto"):
        screen({"tools": [tool]}, "chat")


def test_screening_rules():
    # nulls are left out, accepted fields dropped, inside nested objects too
    assert screen({"text": "hi", "lora_path": None, "log_metrics": True, "no_logs": True, "sampling_params":
                   {"temperature": None, "custom_params": None, "stream_interval": 4}}, "generate") == \
        {"text": "hi", "sampling_params": {}}
    # an unknown field is named at its depth
    for body, scope, path in (({"bogus": 1}, "generate", "bogus"),
                              ({"sampling_params": [{}, {"bogus": 1}]}, "generate",
                               "sampling_params[1].bogus"),
                              ({"stream_options": {"bogus": 1}}, "chat", "stream_options.bogus"),
                              ({"tools": [{"function": {"name": "f", "bogus": 1}}]}, "chat",
                               "tools[0].function.bogus")):
        with pytest.raises(BadRequest) as e:
            screen(body, scope)
        assert str(e.value) == f"`{path}` is not a field this server knows or supports"
        assert error_body(400, str(e.value))["error"]["code"] == "unknown_parameter"
    # an alias is the field it names; both given must agree
    assert screen({"sampling_seed": 7}, "sampling_params") == {"seed": 7}
    assert screen({"sampling_seed": 7, "seed": 7}, "sampling_params") == {"seed": 7}
    with pytest.raises(BadRequest, match="`sampling_seed` and `seed`"):
        screen({"sampling_seed": 7, "seed": 8}, "sampling_params")
    assert screen({"include_stop_str_in_output": True}, "completions") == {"no_stop_trim": True}
    msgs = [{"role": "assistant", "content": [{"type": "text", "text": "a", "prompt_cache_breakpoint": {}}],
             "thinking": "hm", "audio": None}]
    assert screen({"messages": msgs}, "chat")["messages"] == [
        {"role": "assistant", "content": [{"type": "text", "text": "a"}], "reasoning_content": "hm"}]
    with pytest.raises(BadRequest, match=r"`messages\[0\].content\[0\].image_url` = .* read text only"):
        screen({"messages": [{"role": "user",
                              "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
               "chat")


def test_decoded_requests_and_their_structs():
    """Every scope of a struct is the struct's own fields; the SGLang and vLLM spellings decode."""
    assert SCOPE_OF == {GenerateRequest: "generate", CompletionRequest: "completions",
                        ChatCompletionRequest: "chat"}
    _, req = decode_request(json.dumps({"prompt": "p", "best_of": 1, "echo": None, "n": None, "top_k": None,
                                     "structured_outputs": {"choice": ["a", "b"]}, "user": "u"}).encode(),
                         CompletionRequest)
    assert req.n == 1 and req.echo is False \
        and req.structured_outputs.choice == ["a", "b"] and req.user == "u"
    _, req = decode_request(json.dumps({"text": "t", "lora_path": None, "return_routed_experts": False,
                                     "routed_dp_rank": 0}).encode(), GenerateRequest)
    assert req.data_parallel_rank == 0
    with pytest.raises(BadRequest, match="Expected `object`"):
        decode_request(b"[1]", GenerateRequest)


def test_the_document_is_generated_from_the_table():
    doc = (ROOT / "docs" / "api_fields.md").read_text()
    assert doc == markdown(), "docs/api_fields.md is stale: python -m common.api_fields > docs/api_fields.md"
