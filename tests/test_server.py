"""The OpenAI-compatible server, driven by the official openai client over loopback HTTP."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from server_harness import MODEL_NAME, running_server

from kvos.model.tokenizer import load_tokenizer
from kvos.server.main import add_arguments, build_service
from kvos.server.reply import parse_reply

SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 4}


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Any:
    with running_server(model_dir) as url:
        yield url


def client(url: str, key: str = "none") -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def ask(c: OpenAI, messages: list[dict[str, Any]], session: str | None = None, **kw: Any) -> Any:
    headers = {"X-Session-Id": session} if session else None
    return c.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=kw.pop("max_tokens", 6),
        temperature=0,
        extra_headers=headers,
        **kw,
    )


def kvos_usage(response: Any) -> dict[str, Any]:
    return response.usage.model_extra["kvos"]


def test_turn_two_decodes_only_the_new_tail(base: str, model_dir: Path) -> None:
    c = client(base)
    msgs = [SYSTEM, {"role": "user", "content": "first question about the harbour"}]
    r1 = ask(c, msgs, "tail")
    u1 = kvos_usage(r1)
    assert (
        u1["reused_tokens"] == 0
        and u1["decoded_tokens"] == r1.usage.prompt_tokens + r1.usage.completion_tokens
    )
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "second question"},
    ]
    r2 = ask(c, msgs, "tail")
    u2 = kvos_usage(r2)
    history_after_turn_one = u1["active_tokens"]
    assert u2["reused_tokens"] == history_after_turn_one
    new_tail = r2.usage.prompt_tokens - u2["reused_tokens"]
    tail_text = "<|im_start|>user\nsecond question<|im_end|>\n<|im_start|>assistant\n"
    assert new_tail == len(load_tokenizer(model_dir).encode(tail_text))
    assert u2["decoded_tokens"] == new_tail + r2.usage.completion_tokens


def test_streaming_matches_non_streaming(base: str) -> None:
    c = client(base)
    msgs = [SYSTEM, {"role": "user", "content": "stream this please"}]
    full = ask(c, msgs, "stream-a", max_tokens=10)
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "stream-b"},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 10


def test_tools_request(base: str) -> None:
    c = client(base)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    msgs = [SYSTEM, {"role": "user", "content": "weather in Oslo?"}]
    with_tools = ask(c, msgs, "tools-1", tools=[tool])
    without = ask(c, msgs, "tools-2")
    assert with_tools.usage.prompt_tokens >= without.usage.prompt_tokens
    # a conversation that carries a tool call and its result renders and continues
    msgs += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = ask(c, msgs, "tools-1", tools=[tool])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tool_calls_are_parsed_from_the_reply() -> None:
    content, reasoning, calls = parse_reply(
        '<think>plan it</think>Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        "</tool_call>"
    )
    assert (content, reasoning) == ("Checking.", "plan it")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    kept, none, _ = parse_reply("<think>x</think>y", keep_thinking=True)
    assert (kept, none) == ("<think>x</think>y", None)
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_reply(broken) == (broken, None, [])


def test_a_reply_that_is_only_a_call_object_is_a_call() -> None:
    """Small models (Qwen2.5-Coder-0.5B under opencode) write the call without its tags: a reply that is,
    whole, a call object (or a list, or a ```json fence of one) naming an offered tool is that call; text
    around it, or a name not offered, leaves the reply as content."""
    names = ["read", "write"]
    for text in ('{"name": "read", "arguments": {"path": "a.py"}}',
                 '```json\n{"name": "read", "arguments": {"path": "a.py"}}\n```'):  # fmt: skip
        content, _, calls = parse_reply(text, names=names)
        assert content == "" and len(calls) == 1
        assert calls[0]["function"] == {"name": "read", "arguments": '{"path": "a.py"}'}
    pair = '[{"name": "read", "arguments": {}}, {"name": "write", "arguments": {"path": "b"}}]'
    assert [c["function"]["name"] for c in parse_reply(pair, names=names)[2]] == ["read", "write"]
    assert len(parse_reply(pair, names=names, parallel=False)[2]) == 1
    for text in ('Run {"name": "read", "arguments": {}}', '{"name": "delete", "arguments": {}}',
                 '{"name": "read", "arguments": 3}', '{"answer": 42}'):  # fmt: skip
        assert parse_reply(text, names=names) == (text, None, [])
    assert parse_reply('{"name": "read", "arguments": {}}') == ('{"name": "read", "arguments": {}}', None, [])


def test_header_routing_keeps_sessions_apart(base: str) -> None:
    c = client(base)
    msgs = [SYSTEM, {"role": "user", "content": "same opening line for both sessions " * 4}]
    a, b = ask(c, msgs, "route-a"), ask(c, msgs, "route-b")
    assert kvos_usage(a)["session_id"] == "route-a" and kvos_usage(b)["session_id"] == "route-b"
    # two sessions; the second starts from the first's K/V for their shared prompt (test_prefix_sharing.py)
    assert kvos_usage(b)["reused_tokens"] >= max(64, kvos_usage(a)["reused_tokens"])
    more = [
        *msgs,
        {"role": "assistant", "content": b.choices[0].message.content},
        {"role": "user", "content": "b"},
    ]
    ask(c, more, "route-b")
    rows = httpx.get(f"{base}/sessions", timeout=30).json()["data"]
    history = {s["id"]: s["history_tokens"] for s in rows}
    assert history["route-b"] > history["route-a"]  # b went on; a is as it was


def test_prefix_routing_finds_the_session(base: str) -> None:
    c = client(base)
    msgs = [SYSTEM, {"role": "user", "content": "a long opening message for prefix routing " * 3}]
    r1 = ask(c, msgs)
    sid = kvos_usage(r1)["session_id"]
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    r2 = ask(c, msgs)
    assert kvos_usage(r2)["session_id"] == sid and kvos_usage(r2)["reused_tokens"] >= 64
    other = ask(c, [{"role": "user", "content": "a completely different conversation"}])
    assert kvos_usage(other)["session_id"] != sid


def conversation(c: OpenAI, session: str, turns: int) -> list[str]:
    msgs: list[dict[str, Any]] = [SYSTEM]
    replies = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"turn {i}: tell me about tides"})
        r = ask(c, msgs, session, max_tokens=8)
        replies.append(r.choices[0].message.content)
        msgs.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_swap_out_and_in_continue_identically(model_dir: Path) -> None:
    with running_server(model_dir) as url:
        reference = conversation(client(url), "s", 3)
    with running_server(model_dir, max_sessions=1) as url:
        c = client(url)
        msgs: list[dict[str, Any]] = [SYSTEM]
        replies = []
        for i in range(3):
            msgs.append({"role": "user", "content": f"turn {i}: tell me about tides"})
            r = ask(c, msgs, "s", max_tokens=8)
            replies.append(r.choices[0].message.content)
            msgs.append({"role": "assistant", "content": replies[-1]})
            ask(c, [{"role": "user", "content": f"intruder {i}"}], f"other-{i}")  # pushes "s" out of the pool
            listing = httpx.get(f"{url}/sessions").json()["data"]
            assert next(s for s in listing if s["id"] == "s")["swapped"]
        assert kvos_usage(r)["reused_tokens"] > 0
    assert replies == reference


def test_busy_session_waits_or_gets_409(model_dir: Path) -> None:
    with running_server(model_dir, "--busy-timeout", "0") as url:
        busy_session_gets_409(url, model_dir)
    with running_server(model_dir) as url:  # the default: a second request waits its turn
        c = client(url)
        msgs = [SYSTEM, {"role": "user", "content": "long answer"}]
        done: list[Any] = []
        threads = [
            threading.Thread(target=lambda: done.append(ask(c, msgs, "queue", max_tokens=40)))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(done) == 3


def busy_session_gets_409(base: str, model_dir: Path) -> None:
    c = client(base)
    msgs = [SYSTEM, {"role": "user", "content": "long answer"}]
    never_end = {str(t): -100 for t in load_tokenizer(model_dir).eos_ids}  # 400 tokens, no early EOS
    body = {"model": MODEL_NAME, "messages": msgs, "max_tokens": 400, "stream": True, "logit_bias": never_end}
    with httpx.stream(
        "POST", f"{base}/chat/completions", json=body, headers={"X-Session-Id": "busy"}, timeout=60
    ) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream, which cancels the request
        next(lines)  # the first chunk: the request holds the session now
        with pytest.raises(openai.ConflictError) as err:
            ask(c, msgs, "busy")
        assert err.value.body["code"] == "session_busy"  # type: ignore[index]


def test_auth_and_key_scoping(model_dir: Path) -> None:
    with running_server(model_dir, api_keys=["key-one", "key-two"]) as url:
        msgs = [SYSTEM, {"role": "user", "content": "secret plans"}]
        with pytest.raises(openai.AuthenticationError):
            ask(client(url, "wrong"), msgs, "x")
        assert httpx.post(f"{url}/chat/completions", json={}).status_code == 401
        one, two = client(url, "key-one"), client(url, "key-two")
        ask(one, msgs, "shared-name")
        r = ask(two, msgs, "shared-name")
        assert kvos_usage(r)["reused_tokens"] == 0  # key two got a session of its own
        auth = {"Authorization": "Bearer key-two"}
        ids = [s["id"] for s in httpx.get(f"{url}/sessions", headers=auth).json()["data"]]
        assert ids == ["shared-name"]
        httpx.delete(f"{url}/sessions/shared-name", headers=auth).raise_for_status()
        one_sessions = httpx.get(f"{url}/sessions", headers={"Authorization": "Bearer key-one"}).json()[
            "data"
        ]
        assert [s["id"] for s in one_sessions] == ["shared-name"]  # key one's session is untouched
        gone = httpx.delete(f"{url}/sessions/shared-name", headers=auth)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"


def history(url: str, sid: str) -> int:
    return next(s for s in httpx.get(f"{url}/sessions").json()["data"] if s["id"] == sid)["history_tokens"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ('{"model": "kvos-test", "messages": [', 400, "invalid_json"),
        (
            json.dumps(
                {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
            ),
            400,
            "invalid_value",
        ),
        (
            json.dumps({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "invalid_value",
        ),
        (json.dumps({"model": MODEL_NAME, "messages": []}), 400, "invalid_value"),
        (
            json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (
            json.dumps(
                {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
            ),
            400,
            "max_tokens_too_large",
        ),
        (
            json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * (17 << 20)}]}),
            413,
            "request_too_large",
        ),
    ],
)
def test_bad_requests_are_answered_and_leave_the_session_intact(
    base: str, body: str, status: int, code: str
) -> None:
    c = client(base)
    ask(c, [SYSTEM, {"role": "user", "content": "keep me"}], "intact")
    before = history(base, "intact")
    r = httpx.post(
        f"{base}/chat/completions",
        content=body,
        timeout=60,
        headers={"Content-Type": "application/json", "X-Session-Id": "intact"},
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert history(base, "intact") == before


def test_a_body_sent_without_its_length_is_read_to_the_limit(base: str) -> None:
    """Chunked bodies (no Content-Length): one under the limit reaches the endpoint whole, one over it is
    a 413 once the limit is passed."""

    def chunked(body: bytes) -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 16):
            yield body[start : start + (1 << 16)]

    headers = {"Content-Type": "application/json", "X-Session-Id": "chunked"}
    small = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 2}
    r = httpx.post(f"{base}/chat/completions", content=chunked(json.dumps(small).encode()), headers=headers)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 3000
    large = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * (17 << 20)}]}
    r = httpx.post(f"{base}/chat/completions", content=chunked(json.dumps(large).encode()), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_health_and_metrics(base: str) -> None:
    assert httpx.get(base.replace("/v1", "/health")).json()["status"] == "ok"
    missing = httpx.get(f"{base}/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    ask(client(base), [SYSTEM, {"role": "user", "content": "metrics please"}], "metrics")
    text = httpx.get(base.replace("/v1", "/metrics")).text
    for name in (
        "kvos_session_active_tokens",
        "kvos_session_evictions_total",
        "kvos_pool_bytes",
        "kvos_pool_resizes_total",
        "kvos_reused_tokens_total",
        "kvos_decoded_tokens_total",
        "kvos_request_seconds_bucket",
        "kvos_session_saved_ram_bytes",
        "kvos_scheduler_steps_total",
    ):
        assert name in text, name
    # where the scheduler's time went: both parts counted once a request has run
    seconds = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("kvos_scheduler_forward_seconds_total", "kvos_scheduler_turn_seconds_total"))
    }
    assert len(seconds) == 2 and all(v > 0 for v in seconds.values()), seconds


def test_completions_endpoint(base: str) -> None:
    c = client(base)
    r = c.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_headers={"X-Session-Id": "text"},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r2 = c.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time" + r.choices[0].text + " and",
        max_tokens=5,
        temperature=0,
        extra_headers={"X-Session-Id": "text"},
    )
    assert r2.usage.model_extra["kvos"]["reused_tokens"] > 0


def test_long_conversation_stays_within_budget(model_dir: Path) -> None:
    budget = 256
    with running_server(model_dir, budget=budget) as url:
        c = client(url)
        msgs: list[dict[str, Any]] = [SYSTEM]
        turns = 0
        while True:
            msgs.append({"role": "user", "content": f"message {turns}: " + "waves and wind and salt " * 5})
            r = ask(c, msgs, "long", max_tokens=12)
            assert kvos_usage(r)["active_tokens"] <= budget
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            turns += 1
            stats = next(s for s in httpx.get(f"{url}/sessions").json()["data"] if s["id"] == "long")
            if stats["history_tokens"] >= 10 * budget:
                break
        assert stats["max_active_tokens_seen"] <= budget
        assert stats["evictions"] > 0
        tail = f"<|im_start|>user\n{msgs[-2]['content']}<|im_end|>\n<|im_start|>assistant\n"
        expected_tail = len(load_tokenizer(model_dir).encode(tail))  # still only the new message is decoded
        assert r.usage.prompt_tokens - kvos_usage(r)["reused_tokens"] == expected_tail


def test_concurrent_sessions_are_served(base: str) -> None:
    c = client(base)
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = ask(c, [SYSTEM, {"role": "user", "content": f"parallel {i}"}], f"par-{i}").id

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4


def test_harness_hints_reach_the_chunks(model_dir: Path) -> None:
    """kvos.pinned / evoke_pinned pin the new user message, priority scales its chunks, per-message keep
    marks that message, task_boundary snaps the focus."""
    from kvos.engine.engine import Engine
    from kvos.model.loader import load_model
    from kvos.policy.budget import Budget
    from kvos.policy.chunks import ChunkKind
    from kvos.server.schemas import ChatRequest
    from kvos.server.service import ChatService, ServiceConfig
    from kvos.session.config import SessionConfig
    from kvos.session.manager import MemoryManager

    config = SessionConfig(budget=Budget(max_active_tokens=4096), embedder="tokens")
    manager = MemoryManager(Engine(load_model(model_dir)), load_tokenizer(model_dir), config)
    service = ChatService(manager, ServiceConfig(model_name=MODEL_NAME))

    def turn(sid: str, body: dict[str, Any]) -> Any:
        req = ChatRequest.model_validate({"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, **body})
        entry = service.registry.acquire("local", sid, None)
        try:
            gen = service.run(entry, service.prepare_chat(entry, req), req, req)
            for _ in gen:
                pass
        finally:
            service.registry.release(entry)
        return entry.session

    def user_chunks(session: Any) -> list[Any]:
        return [c for c in session.chunks.values() if c.kind is ChunkKind.USER]

    s = turn(
        "a", {"messages": [{"role": "user", "content": "remember"}], "kvos": {"pinned": True, "priority": 3}}
    )
    assert all(c.keep == "pin" and c.priority == 3 for c in user_chunks(s))
    s = turn(
        "b",
        {"messages": [{"role": "user", "content": "remember"}], "evoke_pinned": True, "evoke_priority": 0.5},
    )
    assert all(c.keep == "pin" and c.priority == 0.5 for c in user_chunks(s))
    s = turn("c", {"messages": [{"role": "user", "content": "prefer me", "keep": "prefer"}]})
    assert all(c.keep == "prefer" for c in user_chunks(s))
    s = turn("d", {"messages": [{"role": "user", "content": "topic one"}]})
    snaps = s.memory.journal.count("focus")
    msgs = [
        {"role": "user", "content": "topic one"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "topic one again"},
    ]
    s = turn("d", {"messages": msgs, "evoke_task_boundary": True})
    assert s.memory.journal.count("focus") == snaps + 1


def test_listing_and_metrics_while_a_session_runs(model_dir: Path) -> None:
    """Stats are read from the event loop while the engine thread adds and evicts chunks."""
    with running_server(model_dir, budget=256) as url:
        body = {
            "model": MODEL_NAME,
            "messages": [SYSTEM, {"role": "user", "content": "go " * 50}],
            "max_tokens": 400,
            "stream": True,
            "logit_bias": {str(t): -100 for t in load_tokenizer(model_dir).eos_ids},  # no early end
        }
        statuses: list[int] = []
        with httpx.stream(
            "POST", f"{url}/chat/completions", json=body, headers={"X-Session-Id": "racy"}, timeout=120
        ) as stream:
            for _ in stream.iter_lines():
                statuses.append(httpx.get(f"{url}/sessions").status_code)
                statuses.append(httpx.get(url.replace("/v1", "/metrics")).status_code)
        assert len(statuses) >= 20 and set(statuses) == {200}
        stats = httpx.get(f"{url}/sessions").json()["data"][0]
        assert stats["evictions"] > 0 and stats["max_active_tokens_seen"] <= 256


@pytest.mark.parametrize("signal", ["auto", "answer", "lexical"])
def test_serve_options_reach_the_session_config(
    model_dir: Path, signal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", str(model_dir), "--budget", "512", "--backend", "breadcrumb"]
    args = parser.parse_args(argv + (["--recovery-signal", signal] if signal != "auto" else []))
    config = build_service(args).manager.config
    assert (config.recovery_signal, config.backend, config.budget.max_active_tokens) == (
        signal,
        "breadcrumb",
        512,
    )
    assert config.retriever is None  # this model has none beside it: auto is lexical
    assert config.signal == ("lexical" if signal == "auto" else signal)
    hint = f"no retriever at {model_dir / 'retriever.safetensors'}: `kvos calibrate --retriever"
    assert (hint in capsys.readouterr().err) == (signal == "auto")
