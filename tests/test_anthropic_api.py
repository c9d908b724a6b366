"""Anthropic's Messages API on ``kvos serve`` (its defaults, the built-in model), with the ``anthropic`` SDK
as the client: whole and streamed messages, the async client, a tool round trip that reuses every token,
stop sequences, token counting, errors in Anthropic's shape that leave sessions as they were, keys sent as
``x-api-key``, and cache breakpoints that keep their prefix resident while unmarked chunks are paged out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI
from server_harness import MODEL_NAME, running_app

from kvos.builtin import MODEL_DIR
from kvos.server.service import ChatService

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {  # a bounded string: the built-in model would fill an unbounded one to max_tokens
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
GREEDY = {"temperature": 0}  # the SDK's create() no longer takes temperature; clients still send it


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FastAPI]]:
    with running_app(MODEL_DIR) as (url, app):
        yield url.removesuffix("/v1"), app


def sdk(root: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, session: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.messages.create(
        model=MODEL_NAME,
        max_tokens=kw.pop("max_tokens", 12),
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"X-Session-Id": session},
        extra_body=kw.pop("extra_body", GREEDY),
        **kw,
    )


def prompt_tokens(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)


def history(service: ChatService, session: str) -> tuple[int, ...]:
    with service.registry.cond:
        entry = service.registry.entries[("local", session)]
        return tuple(entry.branches[0].history.token_ids())


def test_a_message_and_the_next_turn_reuse_the_cache(served: tuple[str, FastAPI]) -> None:
    root, app = served
    client = sdk(root)
    first_turn = [{"role": "user", "content": "Please keep my shopping list: eggs, milk, bread."}]
    first = create(client, "shop", first_turn)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL_NAME
    assert first.id.startswith("msg_") and first.stop_reason in ("end_turn", "max_tokens")
    [block] = first.content
    assert block.type == "text" and block.text
    assert first.usage.cache_read_input_tokens == 0 and first.usage.output_tokens > 0
    stored = len(history(app.state.service, "shop"))  # the reply closed as the template closes a turn
    assert prompt_tokens(first.usage) + first.usage.output_tokens < stored <= prompt_tokens(first.usage) + 12
    messages = [
        *first_turn,
        {"role": "assistant", "content": block.text},
        {"role": "user", "content": "Thanks."},
    ]
    second = create(client, "shop", messages)
    assert second.usage.cache_read_input_tokens >= prompt_tokens(first.usage) + first.usage.output_tokens - 1
    assert second.usage.input_tokens < 20  # only the new message (and the generation prompt) was decoded


def test_the_stream_is_anthropics_event_sequence_and_the_same_text(served: tuple[str, FastAPI]) -> None:
    root, _ = served
    client = sdk(root)
    messages = [{"role": "user", "content": "Tell me about the sea and its waves."}]
    whole = create(client, "whole", messages, max_tokens=16)
    kinds: list[str] = []
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=16,
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"X-Session-Id": "streamed"},
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final: Any = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta", "text"}  # the SDK adds a "text" event per delta
    assert final.content[0].text == whole.content[0].text  # greedy: the same reply
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_the_async_client(served: tuple[str, FastAPI]) -> None:
    root, _ = served

    async def two() -> list[Any]:
        client = anthropic.AsyncAnthropic(base_url=root, api_key="none", max_retries=0, timeout=120)
        ask = [
            client.messages.create(
                model=MODEL_NAME,
                max_tokens=8,
                messages=[{"role": "user", "content": f"Note number {i}: remember the colour blue."}],
                extra_headers={"X-Session-Id": f"async-{i}"},
            )
            for i in range(2)
        ]
        return list(await asyncio.gather(*ask))

    replies = asyncio.run(two())
    assert all(r.type == "message" and r.usage.output_tokens > 0 for r in replies)


def test_a_tool_round_trip_reuses_every_token(served: tuple[str, FastAPI]) -> None:
    """A forced call comes back as a tool_use block; the next request carries it and its tool_result, and
    kvos decodes only the result: what it stored for the call is what the client echoed."""
    root, _ = served
    client = sdk(root)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = create(
        client,
        "tools",
        ask,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and use.id
    echoed = [b.model_dump(exclude_none=True, exclude={"citations", "caller"}) for b in first.content]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 degrees."}
    messages: list[dict[str, Any]] = [
        *ask,
        {"role": "assistant", "content": echoed},
        {"role": "user", "content": [result]},
    ]
    second = create(client, "tools", messages, max_tokens=8, tools=[WEATHER])
    assert second.usage.cache_read_input_tokens >= prompt_tokens(first.usage) + first.usage.output_tokens - 1
    none = create(client, "tools-none", ask, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"})
    assert none.stop_reason != "tool_use" and all(b.type == "text" for b in none.content)


def test_stop_sequences_and_token_counts(served: tuple[str, FastAPI]) -> None:
    root, _ = served
    client = sdk(root)
    messages = [{"role": "user", "content": "Hello there, who are you?"}]
    free = create(client, "stop-free", messages, max_tokens=16)
    text = free.content[0].text
    word = text.split()[1]  # a word the greedy reply writes, not at its start
    stopped = create(client, "stop-hit", messages, max_tokens=16, stop_sequences=[word, "zzzz"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == prompt_tokens(free.usage)


BAD_REQUESTS: list[tuple[dict[str, Any], int, str, str]] = [
    ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
        400,
        "invalid_request_error",
        "image",
    ),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        400,
        "invalid_request_error",
        "nope",
    ),
    (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "invalid_request_error",
        "web_search",
    ),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
]


@pytest.mark.parametrize(("change", "status", "kind", "named"), BAD_REQUESTS)
def test_bad_requests_are_anthropic_errors_and_change_nothing(
    served: tuple[str, FastAPI], change: dict[str, Any], status: int, kind: str, named: str
) -> None:
    root, app = served
    service: ChatService = app.state.service
    good = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Remember this."}]}
    r = httpx.post(f"{root}/v1/messages", json=good, headers={"X-Session-Id": "kept"}, timeout=60)
    assert r.status_code == 200
    before = history(service, "kept")
    bad = httpx.post(
        f"{root}/v1/messages", json={**good, **change}, headers={"X-Session-Id": "kept"}, timeout=60
    )
    body = bad.json()
    assert bad.status_code == status and body["type"] == "error", body
    assert body["error"]["type"] == kind and named in body["error"]["message"], body
    assert history(service, "kept") == before


def test_malformed_json_is_an_anthropic_error(served: tuple[str, FastAPI]) -> None:
    root, _ = served
    r = httpx.post(f"{root}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_keys_and_model_names_as_claude_code_sends_them() -> None:
    """The key as ``x-api-key``; the model under a name given with ``--model-alias`` (Claude Code asks for
    its own model names), which the response echoes."""
    alias = "claude-local"
    with running_app(MODEL_DIR, "--model-alias", alias, api_keys=["sk-local-1"]) as (url, _):
        root = url.removesuffix("/v1")
        reply = create(sdk(root, "sk-local-1"), "keyed", [{"role": "user", "content": "Hi."}], max_tokens=2)
        assert reply.type == "message" and reply.model == MODEL_NAME
        aliased = sdk(root, "sk-local-1").messages.create(
            model=alias, max_tokens=2, messages=[{"role": "user", "content": "Hi."}]
        )
        assert aliased.model == alias
        with pytest.raises(anthropic.AuthenticationError) as caught:
            create(sdk(root, "sk-wrong"), "keyed", [{"role": "user", "content": "Hi."}], max_tokens=2)
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_a_cache_breakpoint_keeps_its_prefix_through_evictions() -> None:
    """Under ``kvos serve --budget 256``: a system prompt and first message marked with cache_control stay
    resident while later turns page older, unmarked chunks out; unmarked, the same prefix is paged out."""
    with running_app(MODEL_DIR, budget=256) as (url, app):
        root, service = url.removesuffix("/v1"), app.state.service
        client = sdk(root)
        for session, marked in (("marked", True), ("plain", False)):
            hint = {"cache_control": {"type": "ephemeral"}} if marked else {}
            system = [{"type": "text", "text": "You keep notes for the user. " * 6, **hint}]
            first = {"role": "user", "content": [{"type": "text", "text": "My locker code is 4242.", **hint}]}
            messages: list[dict[str, Any]] = [first]
            for turn in range(5):
                reply = create(client, session, messages, max_tokens=8, system=system)
                messages += [
                    {"role": "assistant", "content": reply.content[0].text},
                    {"role": "user", "content": f"Note {turn}: " + "the river runs past the old mill. " * 10},
                ]
            with service.registry.cond:
                chunks = service.registry.entries[("local", session)].branches[0].chunks.values()
                first_two = sorted(chunks, key=lambda c: c.original_start)[:2]  # system prompt, first message
                evicted = sum(not c.resident for c in chunks)
            assert evicted > 0  # the session outgrew its budget
            assert all(c.resident for c in first_two) == marked, [
                (c.text[:30], c.resident) for c in first_two
            ]


def claude_code_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A request shaped as Claude Code 2.1 sends it (recorded; texts shortened): system blocks with cache
    breakpoints, client tools, a mid-conversation system turn, adaptive thinking, effort, context
    management, its whole output length as max_tokens, streamed."""
    return {
        "model": MODEL_NAME,
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use the tools to help.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [WEATHER, {**WEATHER, "name": "Bash", "description": "Run a command."}],
        "messages": messages,
        "metadata": {"user_id": '{"device_id":"d1","session_id":"s1"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def test_claude_codes_requests_are_served_and_continued(served: tuple[str, FastAPI]) -> None:
    root, app = served
    headers = {
        "X-Claude-Code-Session-Id": "0b9c7f1e-cc21-4f8e-9d1e-2a4c6e8f0a1b",
        "anthropic-version": "2023-06-01",
    }
    first_turn = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>Today is Tuesday.</system-reminder>"},
                {"type": "text", "text": "Fix the bug in calc.py.", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {"role": "system", "content": "Available agent types: claude, Explore."},
    ]
    url = f"{root}/v1/messages?beta=true"
    r = httpx.post(url, json=claude_code_body(first_turn), headers=headers, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert (
        r.status_code == 200 and events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    )
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    first = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert first["output_tokens"] <= 4096  # max_tokens 32,000 was lowered to the server's limit, not refused
    assert ("local", headers["X-Claude-Code-Session-Id"]) in app.state.service.registry.entries
    more = [
        *first_turn,
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Run the tests."},
    ]
    r = httpx.post(url, json=claude_code_body(more), headers=headers, timeout=120)
    second = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    usage = next(e for e in second if e["type"] == "message_delta")["usage"]
    prompt = first["input_tokens"] + first["cache_creation_input_tokens"] + first["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= prompt + first["output_tokens"] - 1  # the --continue turn


def test_a_streamed_tool_call_is_a_tool_use_block_with_its_json(served: tuple[str, FastAPI]) -> None:
    root, _ = served
    client = sdk(root)
    kinds: list[str] = []
    deltas: list[str] = []
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=200,
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        # exactly one call: a forced tool may otherwise be called several times in parallel, as Anthropic's
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_headers={"X-Session-Id": "streamed-tool"},
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        final: Any = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    assert json.loads("".join(deltas)) == use.input and isinstance(use.input["city"], str)
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_thinking_follows_the_templates_switch() -> None:
    """``thinking`` maps onto a template's ``enable_thinking`` (Qwen3's); adaptive leaves the default."""
    from kvos.server.anthropic import MessagesRequest, to_chat

    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Hi"}]}
    on = to_chat(MessagesRequest.model_validate({**body, "thinking": {"type": "enabled"}}), True)
    off = to_chat(MessagesRequest.model_validate({**body, "thinking": {"type": "disabled"}}), True)
    adaptive = to_chat(MessagesRequest.model_validate({**body, "thinking": {"type": "adaptive"}}), False)
    assert on.chat_template_kwargs == {"enable_thinking": True}
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert adaptive.chat_template_kwargs is None
    clipped = to_chat(MessagesRequest.model_validate({**body, "max_tokens": 32000}), False, 4096)
    assert clipped.max_tokens == 4096
