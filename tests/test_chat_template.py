"""Chat templates render exactly as transformers' ``apply_chat_template(..., tokenize=False)`` does."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvos.errors import TokenizerError
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# ChatML in the style of Qwen2.5: a default system prompt, tools listed in the system turn, tool calls in
# assistant turns and consecutive tool results grouped into one user turn.
CHATML_TOOLS = r"""
{%- set default_system = 'You are a helpful assistant.' %}
{%- if messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
{%- else %}
    {%- set system_text = default_system %}
{%- endif %}
{{- '<|im_start|>system\n' + system_text }}
{%- if tools %}
    {{- '\n\n# Tools\n\nYou may call functions. Their signatures, inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nAnswer a call as <tool_call>\n{"name": <name>, "arguments": <json>}\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role == 'user' or message.role == 'system'
             or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": '
                + (call.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama-3 style, deliberately written without "-" whitespace control so that trim_blocks/lstrip_blocks matter.
LLAMA3 = r"""{{ bos_token }}
{% if date_string is not defined %}
    {% set date_string = strftime_now("%d %b %Y") %}
{% endif %}
{% if messages[0]['role'] == 'system' %}
    {% set system_message = messages[0]['content'] | trim %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set system_message = "" %}
    {% set loop_messages = messages %}
{% endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}
{% if tools is not none %}
Environment: ipython
{% endif %}

{{ system_message }}<|eot_id|>
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if loop.first and tools is not none %}
<|start_header_id|>user<|end_header_id|>

Use these functions:
        {% for t in tools %}
{{ t | tojson(indent=4) }}

        {% endfor %}
{{ message['content'] | trim }}<|eot_id|>
    {% else %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
   + message['content'] | trim + '<|eot_id|>' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}
"""

# Qwen3 style: thinking kept only for the turns after the last user query, <think> split out of content,
# and enable_thinking=false pre-filling an empty think block.
QWEN3 = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' and not (message.content.startswith('<tool_response>')) %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n'
                + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city — e.g. Zürich or 東京",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {}}},
]
SIMPLE = [{"role": "user", "content": "Hi there! café 你好 🙂"}]
WITH_SYSTEM = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOL_FLOW = [
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "now", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": '{"temp": 21, "sky": "sunny ☀"}'},
    {"role": "tool", "content": '"12:00"'},
    {"role": "assistant", "content": "Sunny, 21°C, at noon."},
    {"role": "user", "content": "Thanks"},
]
THINKING = [
    {"role": "system", "content": "Think first."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "reasoning_content": "need a tool"},
    {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
    {"role": "assistant", "content": "It is sunny.", "reasoning": "the tool said so"},
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    raw.train_from_iterator(["hello world, the weather is sunny in Zürich"] * 20, trainer)
    return str(raw.to_str())


def make_pair(directory: Path, tokenizer_json: str, template: str, **tokens: str) -> tuple[ChatTemplate, Any]:
    """Our ChatTemplate (via load_tokenizer) and transformers' tokenizer for the same directory."""
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tokenizer_json)
    config = {"chat_template": template, "pad_token": "<|endoftext|>", **tokens}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ChatTemplate.from_tokenizer(load_tokenizer(directory))
    return ours, transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> tuple[ChatTemplate, Any]:
    path = tmp_path_factory.mktemp("chatml") / "tok"
    return make_pair(path, tokenizer_json, CHATML_TOOLS, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> tuple[ChatTemplate, Any]:
    path = tmp_path_factory.mktemp("llama3") / "tok"
    return make_pair(path, tokenizer_json, LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> tuple[ChatTemplate, Any]:
    path = tmp_path_factory.mktemp("qwen3") / "tok"
    return make_pair(path, tokenizer_json, QWEN3, eos_token="<|im_end|>")


def same(pair: tuple[ChatTemplate, Any], messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Render with both and assert the strings are identical; returns the rendered text."""
    ours, ref = pair
    expected = ref.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)
    assert isinstance(expected, str)
    before = copy.deepcopy(messages)
    assert ours.render(messages, **kwargs) == expected
    assert messages == before  # the caller's messages are untouched
    return expected


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", [SIMPLE, WITH_SYSTEM, TOOL_FLOW], ids=["simple", "system", "tool_flow"])
def test_chatml_with_tools(chatml: tuple[ChatTemplate, Any], messages: list, tools: Any, gen: bool) -> None:
    text = same(chatml, messages, add_generation_prompt=gen, tools=tools)
    assert text.endswith("<|im_start|>assistant\n") == gen
    assert ("<tools>" in text) == (tools is not None)
    assert ("You are a helpful assistant." in text) == (messages is not WITH_SYSTEM)
    if tools is not None:
        assert "Zürich or 東京" in text  # tojson keeps non-ASCII as is
    if messages is TOOL_FLOW:
        assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text
        assert text.count("<|im_start|>user\n<tool_response>") == 1  # consecutive tool results grouped


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", [SIMPLE, WITH_SYSTEM], ids=["simple", "system"])
def test_llama3(llama3: tuple[ChatTemplate, Any], messages: list, tools: Any, gen: bool) -> None:
    text = same(llama3, messages, add_generation_prompt=gen, tools=tools, date_string="26 Jul 2024")
    assert text.startswith("<|begin_of_text|>\n<|start_header_id|>system")
    assert "Today Date: 26 Jul 2024" in text and ("Environment: ipython" in text) == (tools is not None)
    if tools is not None:
        assert '{\n    "type": "function",' in text  # tojson(indent=4)
    same(llama3, messages, add_generation_prompt=gen, tools=tools)  # date from strftime_now


def test_llama3_raise_exception_is_a_tokenizer_error(llama3: tuple[ChatTemplate, Any]) -> None:
    ours, ref = llama3
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TokenizerError, match="roles must alternate") as caught:
        ours.render(bad)
    with pytest.raises(Exception, match="roles must alternate") as hf_caught:
        ref.apply_chat_template(bad, tokenize=False)
    assert str(hf_caught.value) in str(caught.value)


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("messages", [SIMPLE, WITH_SYSTEM, THINKING], ids=["simple", "system", "thinking"])
def test_qwen3_thinking(qwen3: tuple[ChatTemplate, Any], messages: list, thinking: Any, gen: bool) -> None:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = same(qwen3, messages, add_generation_prompt=gen, **kwargs)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (gen and thinking is False)
    if messages is THINKING:
        assert "add them" not in text and "\n4<|im_end|>" in text  # old thinking dropped
        assert "<think>\nneed a tool\n</think>\n\n<|im_end|>" in text  # after the last query: kept
        assert "<think>\nthe tool said so\n</think>\n\nIt is sunny." in text  # "reasoning" aliased


def test_template_features_match(tmp_path: Path, tokenizer_json: str) -> None:
    template = (
        "{% set d = dict(a=1, b=[1, 2]) %}{{ d | tojson(separators=(',', ':'), sort_keys=true) }}|"
        "{% generation %}{{ messages[-1].content }}{% endgeneration %}|{{ pad_token }}|{{ eos_token }}|"
        "{{ bos_token }}|{{ tools }}|{{ documents }}|{{ extra_flag }}|{{ messages[0].name is defined }}"
    )
    pair = make_pair(tmp_path / "t", tokenizer_json, template)
    expected = '{"a":1,"b":[1,2]}|Hi there! café 你好 🙂|<|endoftext|>|||None|None||False'
    assert same(pair, [{**SIMPLE[0], "name": None}]) == expected  # None-valued keys are dropped
    same(pair, SIMPLE, extra_flag=[1, "x"], pad_token="overridden")


def test_errors_are_tokenizer_errors() -> None:
    with pytest.raises(TokenizerError, match="syntax error at line 1"):
        ChatTemplate("{% if %}")
    template = ChatTemplate("{{ messages[0].content }}")
    with pytest.raises(TokenizerError, match="empty conversation"):
        template.render([])
    with pytest.raises(TokenizerError, match="as a dict"):
        template.render(["hello"])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(SIMPLE)
    with pytest.raises(TokenizerError, match="failed to render"):  # the sandbox refuses mutation
        ChatTemplate("{{ messages.append(1) }}").render(SIMPLE)
    with pytest.raises(TokenizerError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(SIMPLE)
    with pytest.raises(TokenizerError, match="no chat template"):
        ChatTemplate.from_tokenizer(type("T", (), {"chat_template": None})())


def test_direct_construction() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ unk_token }}",
        bos_token="<s>",
        eos_token="</s>",
        special_tokens={"unk_token": "<unk>", "bos_token": "<ignored>"},
    )
    assert template.render(SIMPLE) == "<s>Hi there! café 你好 🙂</s><unk>"
    assert template.render(SIMPLE, bos_token="[B]") == "[B]Hi there! café 你好 🙂</s><unk>"
