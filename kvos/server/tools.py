"""Tools for every model: ``tools`` / ``tool_choice`` checked, rendered and forced.

When the model's chat template renders ``tools`` itself, kvos passes them through. When it does not
(rendering with and without them gives the same text), kvos renders them in a documented default, as
llama.cpp's generic format does: a block appended to the system prompt that lists each function's JSON
schema and asks for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` replies; earlier assistant
tool calls are written the same way into their message. Replies are parsed by :mod:`kvos.server.reply`.
``tool_choice`` ``"required"`` or a named function forces a call by constrained decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvos.engine.constraint import TOOL_CLOSE, TOOL_OPEN, Grammar
from kvos.errors import KvosError
from kvos.model.chat_template import ChatTemplate
from kvos.server.errors import APIError, bad_request
from kvos.server.schemas import ChatRequest

TOOLS_PREAMBLE = (
    "You can call functions. These are the functions you may call, as JSON schemas:\n"
    "{functions}\n\n"
    "To call a function, reply with a JSON object naming it and giving its arguments, inside tags:\n"
    f'{TOOL_OPEN}\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n{TOOL_CLOSE}\n'
    "Write one such block per call. If no call is needed, answer normally."
)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this turn: the functions offered (OpenAI function objects: name,
    description, parameters), the ones a call is forced to (empty: not forced), parallel calls allowed."""

    offered: list[dict[str, Any]]
    forced: list[dict[str, Any]]
    parallel: bool

    def grammar(self) -> Grammar | None:
        return Grammar.tool_calls(self.forced, self.parallel) if self.forced else None


def _bad(param: str, message: str) -> APIError:
    return bad_request(message, "invalid_tools", param)


def plan_tools(req: ChatRequest) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and say what they ask for."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise _bad(f"tools[{i}]", "each tool must be {'type': 'function', 'function': {'name': ...}}")
        functions.append(fn)
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none" or not functions:
        if choice not in ("none", "auto"):
            raise _bad("tool_choice", "tool_choice asks for a tool call but the request has no tools")
        return ToolPlan([], [], parallel)
    if choice == "auto":
        return ToolPlan(functions, [], parallel)
    if choice == "required":
        return ToolPlan(functions, functions, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise _bad("tool_choice", "tool_choice must be none, auto, required or a named function")
    named = [fn for fn in functions if fn["name"] == name]
    if not named:
        raise _bad("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return ToolPlan(functions, named, parallel)


def template_inputs(
    template: ChatTemplate, req: ChatRequest, extra: Sequence[dict[str, Any]] = ()
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render the request's conversation (then ``extra`` messages) with: the tools
    offered go to the template when it renders them, else into the messages in kvos's default format."""
    messages = [m.as_template_dict() for m in req.messages] + list(extra)
    plan = plan_tools(req)
    if not plan.offered:
        return messages, None
    tools = [t for t in req.tools or [] if t.get("function") in plan.offered]
    if renders_tools(template, messages, tools, req.chat_template_kwargs or {}):
        return messages, tools
    return default_tools(messages, plan.offered), None


def renders_tools(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: list[Any], extra: dict[str, Any]
) -> bool:
    """True when the template's text changes with the tools (it renders them itself); a template that
    fails with tools (some raise on purpose) cannot render them."""
    try:
        with_tools = template.render(messages, add_generation_prompt=True, tools=tools, **extra)
    except KvosError:
        return False
    return with_tools != template.render(messages, add_generation_prompt=True, **extra)


def default_tools(messages: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with kvos's default tool rendering: the functions listed at the end of the system
    prompt (a system message is added first when there is none), assistant tool calls written as
    ``<tool_call>`` blocks in their message's content."""
    listing = "\n".join(json.dumps(fn, ensure_ascii=False, sort_keys=True) for fn in functions)
    block = TOOLS_PREAMBLE.replace("{functions}", listing)
    out = [_calls_as_text(m) for m in messages]
    if out and out[0].get("role") in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "content": f"{first.get('content') or ''}\n\n{block}".lstrip("\n")}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    blocks = []
    for call in calls:
        fn = call.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        body = json.dumps({"name": fn.get("name"), "arguments": parsed}, ensure_ascii=False)
        blocks.append(f"{TOOL_OPEN}\n{body}\n{TOOL_CLOSE}")
    text = "\n".join([message.get("content") or "", *blocks]).strip("\n")
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": text}
