"""Tools for every model: passed to a template that renders them, kvos's default rendering otherwise, and
tool_choice / parallel_tool_calls read into what a turn offers and forces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvos.engine.constraint import Grammar
from kvos.model.chat_template import ChatTemplate
from kvos.server.errors import APIError
from kvos.server.schemas import ChatRequest
from kvos.server.tools import plan_tools, template_inputs

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
RENDERS = "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}" + CHATML
REFUSES = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + CHATML
FN = {"name": "lookup", "description": "Find a word", "parameters": {"type": "object", "properties": {}}}
TOOL = {"type": "function", "function": FN}


def request(**kw: Any) -> ChatRequest:
    messages = kw.pop("messages", [{"role": "user", "content": "hi"}])
    return ChatRequest.model_validate({"model": "m", "messages": messages, "tools": [TOOL], **kw})


def test_a_template_that_renders_tools_gets_them() -> None:
    messages, tools = template_inputs(ChatTemplate(RENDERS), request())
    assert tools == [TOOL] and messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source", [CHATML, REFUSES])
def test_otherwise_the_default_block_goes_into_the_system_prompt(source: str) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"},
    ]
    messages, tools = template_inputs(ChatTemplate(source), request(messages=history))
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(FN, sort_keys=True) in system
    assert "<tool_call>" in system
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>',
    }
    assert messages[3] == history[3]
    bare, _ = template_inputs(ChatTemplate(source), request())
    assert bare[0]["role"] == "system" and bare[1] == {"role": "user", "content": "hi"}


def test_tool_choice_none_offers_nothing() -> None:
    assert template_inputs(ChatTemplate(CHATML), request(tool_choice="none")) == (
        [{"role": "user", "content": "hi"}],
        None,
    )


def test_tool_choice_and_parallel_calls_are_read() -> None:
    assert plan_tools(request()).forced == [] and plan_tools(request()).grammar() is None
    assert plan_tools(request(tool_choice="required")).forced == [FN]
    named = plan_tools(request(tool_choice={"type": "function", "function": {"name": "lookup"}}))
    assert named.forced == [FN] and named.parallel
    assert named.grammar() == Grammar.tool_calls([FN], parallel=True)
    single = plan_tools(request(tool_choice="required", parallel_tool_calls=False))
    assert single.grammar() == Grammar.tool_calls([FN], parallel=False) != named.grammar()


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        plan_tools(request(**kw))
    assert err.value.status == 400 and err.value.param == param
