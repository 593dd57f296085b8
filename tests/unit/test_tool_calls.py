"""Tool-call parsing (`common/server/tool_calls.py`): what `tools` / `tool_choice` mean, and how an answer
splits into content and calls, whole and streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest

from common.protocol import BadRequest
from common.server.tool_calls import ToolStream, parse_answer, plan_tools

TEMPLATE = "{% if tools %}{{ tools }}{% endif %}"
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}
ANSWER = ('Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
          '<tool_call>{"name": "g", "arguments": {}}</tool_call> <tool_call>not json</tool_call> done')


def streamed(plan, text: str, step: int):
    s, content, calls = ToolStream(plan), "", []
    for end in range(step, len(text) + step, step):
        c, k = s.feed(text[:end], end >= len(text))
        content += c
        calls += k
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_parses_calls_whole_and_streamed(step):
    plan = plan_tools([F, G], "auto", True, TEMPLATE)
    assert plan.grammar is None and plan.tools == [F, G]
    content, calls = parse_answer(plan, ANSWER)
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert content == "Let me look. \n <tool_call>not json</tool_call> done"
    s_content, s_calls = streamed(plan, ANSWER, step)
    assert [c["function"] for c in s_calls] == [c["function"] for c in calls]
    assert s_content.replace(" ", "").replace("\n", "") == content.replace(" ", "").replace("\n", "")
    single = plan_tools([F, G], "auto", False, TEMPLATE)
    assert len(parse_answer(single, ANSWER)[1]) == 1 and len(streamed(single, ANSWER, step)[1]) == 1


def test_forced_choices_build_grammars():
    named = plan_tools([F, G], {"type": "function", "function": {"name": "f"}}, True, TEMPLATE)
    assert named.grammar == ("json_schema", json.dumps(F["function"]["parameters"]))
    assert parse_answer(named, '{"x": 3}')[1][0]["function"] == {"name": "f", "arguments": '{"x": 3}'}
    required = plan_tools([F, G], "required", False, TEMPLATE)
    schema = json.loads(required.grammar[1])
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    content, calls = parse_answer(required, '[{"name": "g", "arguments": {}}]')
    assert content is None and calls[0]["function"]["name"] == "g"
    assert plan_tools([F], "none", True, TEMPLATE).tools is None


@pytest.mark.parametrize("tools,choice,template,field", [
    ([F], "auto", "{{ messages }}", "`tools`"),
    ([F], {"type": "function", "function": {"name": "h"}}, TEMPLATE, "`tool_choice.function.name`"),
    ([F], "sometimes", TEMPLATE, "`tool_choice`"),
    (None, "required", TEMPLATE, "`tool_choice`"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", TEMPLATE, "`tools[0].function.name`"),
    ([F, F], "auto", TEMPLATE, "`tools[1].function.name`"),
    ([{"type": "code"}], "auto", TEMPLATE, "`tools[0]`"),
])
def test_bad_tools_name_the_field(tools, choice, template, field):
    with pytest.raises(BadRequest, match=field.replace("[", r"\[").replace("]", r"\]")):
        plan_tools(tools, choice, True, template)
