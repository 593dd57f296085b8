"""Tool calling on `/v1/chat/completions`: OpenAI's `tools` and `tool_choice`.

* The tools go to the model's chat template (`tools=`), which must know them (Qwen2/Qwen3 style
  templates do; a template that never mentions `tools` is refused with a 400).
* `tool_choice` `auto` (the default with tools): the model decides; calls it writes in the Hermes/Qwen
  form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` are parsed out of the answer into
  `tool_calls`, the rest stays `content`. `none`: the tools are not shown to the model and nothing is
  parsed.
* `required` and a named function are enforced with a grammar, so the arguments are always valid JSON
  for the function's `parameters` schema: `required` makes the answer a JSON array of
  `{"name", "arguments"}` objects (one per call; one only without `parallel_tool_calls`), a named
  function makes it that function's arguments object.

A streamed answer sends each call as one `tool_calls` delta (name and whole arguments) when its text is
complete, and holds back content that may be the start of a `<tool_call>` tag.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from common.protocol import BadRequest

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.DOTALL)
MAX_TOOLS = 128


@dataclass
class ToolPlan:
    """What a chat request's `tools` and `tool_choice` mean for its prompt and its answer."""

    tools: list[dict[str, Any]] | None  # passed to the chat template (None: no tools shown)
    mode: str  # "none", "auto", "required" or "named"
    grammar: tuple[str, str] | None  # the constraint of a forced call
    function: str | None = None  # the named function
    parallel: bool = True  # several calls in one answer (`parallel_tool_calls`); else the first only


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"`tools` has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        # vLLM's tools may leave `type` out: a function is the only kind
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(t.get("function"), dict):
            raise BadRequest(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise BadRequest(f"`tools[{i}].function.name` must be 1 to 64 letters, digits, `_`, `.` or `-`")
        if name in out:
            raise BadRequest(f"`tools[{i}].function.name` {name!r} is given twice")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest(f"`tools[{i}].function.parameters` must be a JSON schema object")
        out[name] = params
    return out


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool,
               template: str | None) -> ToolPlan:
    """Check `tools` / `tool_choice` and say how the request runs; BadRequest names the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadRequest("`tool_choice` needs `tools`")
        return ToolPlan(None, "none", None)
    funcs = _functions(tools)
    if tool_choice is None or tool_choice == "auto":
        mode = "auto"
    elif tool_choice in ("none", "required"):
        mode = tool_choice
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise BadRequest("`tool_choice` must be none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in funcs:
            raise BadRequest(f"`tool_choice.function.name` {name[:64]!r} is not one of `tools`")
        mode = "named"
    else:
        raise BadRequest("`tool_choice` must be none, auto, required or a named function")
    if mode == "none":
        return ToolPlan(None, "none", None)
    if not template or "tools" not in template:
        raise BadRequest("`tools`: this model's chat template does not take tools (start the node with a "
                         "--chat-template that does, e.g. a Qwen2/Qwen3 template)")
    if mode == "named":
        return ToolPlan(tools, mode, ("json_schema", json.dumps(funcs[name])), name, parallel)
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in funcs.items()]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(tools, mode, ("json_schema", json.dumps(schema)), None, parallel)
    return ToolPlan(tools, mode, None, None, parallel)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": args}}


def parse_answer(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished answer."""
    if plan.mode == "named":
        return None, [_call(plan.function, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut by the length limit: no call could be parsed
            return text, []
        return None, [_call(c["name"], c["arguments"]) for c in items]
    if plan.mode != "auto":
        return text, []
    calls, content, pos = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue  # not a call: it stays text
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        if plan.parallel or not calls:  # without parallel calls a later one is dropped
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        content.append(text[pos:m.start()])
        pos = m.end()
    if not calls:
        return text, []
    content.append(text[pos:])
    return "".join(content).strip() or None, calls


class ToolStream:
    """Splits a streamed answer into content deltas and complete tool calls (`feed(text, final)`)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0  # characters of the text handled so far
        self.calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.mode in ("named", "required"):
            if not final:
                return "", []
            content, calls = parse_answer(self.plan, text)
            self.calls = len(calls)
            return content or "", calls
        if self.plan.mode != "auto":
            delta, self.sent = text[self.sent:], len(text)
            return delta, []
        content, calls = [], []
        while True:
            rest = text[self.sent:]
            start = rest.find(CALL_START)
            if start == -1:
                keep = 0 if final else _partial_tag(rest)
                content.append(rest[:len(rest) - keep])
                self.sent += len(rest) - keep
                break
            content.append(rest[:start])
            end = rest.find(CALL_END, start)
            if end == -1:
                if final:
                    content.append(rest[start:])
                    self.sent = len(text)
                else:
                    self.sent += start
                break
            block = rest[start:end + len(CALL_END)]
            _, parsed = parse_answer(self.plan, block)
            if not parsed:
                content.append(block)  # not a call after all: it stays text
            elif self.plan.parallel or self.calls + len(calls) == 0:
                calls += parsed  # (without parallel calls a later call is dropped, as parse_answer does)
            self.sent += end + len(CALL_END)
        self.calls += len(calls)
        return "".join(content), calls


def _partial_tag(text: str) -> int:
    """Length of the tail of `text` that may be the beginning of `<tool_call>`."""
    for k in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-k:]):
            return k
    return 0


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's assistant tool calls carry their arguments as JSON text; templates expect objects."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
    return messages
