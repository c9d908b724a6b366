"""What agent harnesses send, against ``kvos serve``'s own defaults on the built-in model (1,024 positions):
conversations longer than the context, cancelled requests, side requests under one session id."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from server_harness import MODEL_NAME, running_server

from kvos.builtin import MODEL_DIR
from kvos.engine.engine import Engine
from kvos.model.tokenizer import load_tokenizer

CONTEXT = 1024  # the built-in model's positions
TOKENIZER = load_tokenizer(MODEL_DIR)
NEVER_END = {str(t): -100 for t in TOKENIZER.eos_ids}  # a reply that runs to max_tokens


def client(url: str, timeout: float = 120) -> OpenAI:
    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout)


def ask(c: OpenAI, messages: list[dict[str, Any]], session: str, **kw: Any) -> Any:
    return c.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=kw.pop("max_tokens", 12),
        temperature=0,
        extra_headers={"X-Session-Id": session},
        **kw,
    )


def usage(response: Any) -> dict[str, Any]:
    return dict(response.usage.model_extra["kvos"])


def session_stats(url: str, sid: str) -> dict[str, Any] | None:
    rows = httpx.get(f"{url}/sessions", timeout=30).json()["data"]
    return next((s for s in rows if s["id"] == sid), None)


def wait_idle(url: str, sid: str, limit: float = 10.0) -> float:
    """Seconds until the session is no longer busy (fails past ``limit``)."""
    began = time.monotonic()
    while (stats := session_stats(url, sid)) is not None and stats["busy"]:
        assert time.monotonic() - began < limit, f"session {sid} still busy after {limit} s"
        time.sleep(0.02)
    return time.monotonic() - began


def tail_tokens(content: str) -> int:
    """Tokens of a new user message plus the generation prompt, as the built-in ChatML template renders."""
    return len(TOKENIZER.encode(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"))


@pytest.fixture(scope="module")
def default_url() -> Iterator[str]:
    with running_server(MODEL_DIR) as url:
        yield url


def test_default_budget_fits_the_model() -> None:
    from kvos.server.main import default_budget

    assert default_budget(CONTEXT, None) == 768  # max(2048, 0.75 x 1024) clipped to 1024 - 256
    assert default_budget(8192, None) == 6144
    assert default_budget(CONTEXT, 4096) == 768  # an explicit budget past what the model attends to too
    assert default_budget(CONTEXT, 512) == 512


def test_sixty_turns_far_past_the_context() -> None:
    budget = 512
    with running_server(MODEL_DIR, budget=budget) as url:
        c = client(url)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
        for turn in range(60):
            content = (
                f"Note {turn}: the crate numbered {turn * 37 % 101} holds {turn % 9 + 2} lanterns, "
                f"and the ferry to island {turn % 7} leaves at {8 + turn % 10} o'clock; please remember it. "
                f"Also the garden behind house {turn % 11} grows {turn % 5 + 3} rows of beans and the "
                f"baker on street {turn % 13} sells bread for {turn % 4 + 1} coins."
            )
            msgs.append({"role": "user", "content": content})
            r = ask(c, msgs, "long")
            u = usage(r)
            assert r.usage.completion_tokens > 0
            assert u["active_tokens"] <= budget
            if turn:
                assert r.usage.prompt_tokens - u["reused_tokens"] == tail_tokens(content)  # only the new tail
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        stats = session_stats(url, "long")
        assert stats is not None
        assert stats["history_tokens"] > 5 * CONTEXT
        assert stats["max_active_tokens_seen"] <= budget
        assert stats["evictions"] > 0


def agent_request() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An opencode-shaped first request: a system prompt of >= 8,000 characters and 10 tool schemas."""
    rules = " ".join(
        f"Rule {i}: read a file before you edit it, keep each answer short, and never invent paths."
        for i in range(110)
    )
    system = f"You are a coding agent working in a repository. {rules}"
    assert len(system) >= 8000
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool {i}: reads, lists or edits files of the repository in way number {i}.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["path"],
                },
            },
        }
        for i in range(10)
    ]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "My favourite number is 42."},
    ]
    return messages, tools


def test_agent_shaped_first_request_is_answered_then_reused(default_url: str) -> None:
    c = client(default_url)
    messages, tools = agent_request()
    first = ask(c, messages, "agent", tools=tools)
    u1 = usage(first)
    assert first.usage.prompt_tokens > 4 * CONTEXT
    assert u1["active_tokens"] <= 768 and u1["evictions"] > 0
    assert first.usage.completion_tokens > 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What is my favourite number?"},
    ]
    second = ask(c, messages, "agent", tools=tools)
    u2 = usage(second)
    assert u2["reused_tokens"] >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert u2["active_tokens"] <= 768


@pytest.mark.parametrize("argv", [(), ("--embedder", "hidden")])
def test_evicting_runs_no_forward_pass_to_embed_by_default(
    monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    """The turn that first evicts scores every resident chunk's coherence with the task focus: with the
    default (token) embedder that costs no forward pass; the hidden-state embedder, still selectable, ran
    one per chunk and per user message (on SmolLM2 22 of the 25 s of that turn)."""
    forward = Engine.hidden_states
    passes: list[int] = []

    def counted(engine: Engine, token_ids: Sequence[int]) -> torch.Tensor:
        passes.append(len(token_ids))
        return forward(engine, token_ids)

    monkeypatch.setattr(Engine, "hidden_states", counted)
    with running_server(MODEL_DIR, *argv) as url:
        messages, tools = agent_request()
        u = usage(ask(client(url), messages, "agent", tools=tools))
    assert u["evictions"] > 0
    assert (passes != []) == bool(argv)  # hidden: the user message and the resident chunks scored


def open_stream(url: str, sid: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": 400,
        "stream": True,
        "logit_bias": NEVER_END,
    }
    request = httpx.Request("POST", f"{url}/chat/completions", json=body, headers={"X-Session-Id": sid})
    return httpx.Client(timeout=60).send(request, stream=True)


def test_cancelled_stream_releases_the_session(default_url: str) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    response = open_stream(default_url, "cancel", messages)
    lines = response.iter_lines()
    chunks = [next(lines) for _ in range(8)]
    assert all(line.startswith("data: ") or not line for line in chunks)
    response.close()  # the client goes away after a few chunks
    waited = wait_idle(default_url, "cancel")
    stats = session_stats(default_url, "cancel")
    assert stats is not None and stats["history_tokens"] == tail_tokens(messages[0]["content"])  # rolled back
    r = ask(client(default_url), messages, "cancel")
    assert r.usage.completion_tokens > 0
    assert usage(r)["reused_tokens"] == r.usage.prompt_tokens - 1  # the whole prompt was kept
    assert waited < 10


def test_non_streaming_client_timeout_releases_the_session(default_url: str) -> None:
    messages = [{"role": "user", "content": "Count slowly to a thousand."}]
    with pytest.raises(openai.APITimeoutError):
        client(default_url, timeout=0.5).chat.completions.create(
            model=MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4000,
            logit_bias=NEVER_END,  # type: ignore[arg-type]
            extra_headers={"X-Session-Id": "timeout"},
        )
    wait_idle(default_url, "timeout")
    stats = session_stats(default_url, "timeout")
    assert stats is not None and stats["history_tokens"] == tail_tokens(messages[0]["content"])
    r = ask(client(default_url), messages, "timeout")
    assert r.usage.completion_tokens > 0


def test_delete_cancels_a_busy_session(default_url: str) -> None:
    response = open_stream(default_url, "doomed", [{"role": "user", "content": "Describe every wave."}])
    lines = response.iter_lines()
    next(lines)
    next(lines)
    r = httpx.delete(f"{default_url}/sessions/doomed", timeout=60)
    assert r.status_code == 200 and r.json()["deleted"] is True
    rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "cancelled"
    response.close()
    assert session_stats(default_url, "doomed") is None


def test_side_requests_keep_the_main_branch(default_url: str) -> None:
    c = client(default_url)
    main_system = {"role": "system", "content": "You are a coding agent. " + "Be careful with files. " * 30}
    title_system = {"role": "system", "content": "Write a short title for the conversation."}
    user1 = {"role": "user", "content": "Please look at the parser and tell me what it does with tabs."}
    first = ask(c, [main_system, user1], "oc")
    history = first.usage.prompt_tokens + first.usage.completion_tokens
    title = ask(c, [title_system, user1], "oc")  # opencode's title request, same session header
    assert usage(title)["branch"] != "main"
    reply1 = {"role": "assistant", "content": first.choices[0].message.content}
    user2 = {"role": "user", "content": "And what does it do with spaces?"}
    second = ask(c, [main_system, user1, reply1, user2], "oc")
    reuse = usage(second)["reused_tokens"] / history
    assert reuse >= 0.95, f"main turn 2 reused {reuse:.1%} of main turn 1's history"
    assert usage(second)["branch"] == "main"
    summary_system = {"role": "system", "content": "Summarise the conversation for a later session."}
    reply2 = {"role": "assistant", "content": second.choices[0].message.content}
    compact = ask(c, [summary_system, user1, reply1, user2, reply2], "oc")  # the compaction request
    assert usage(compact)["branch"] not in ("main", usage(title)["branch"])
    third = ask(c, [main_system, user1, reply1, user2, reply2, {"role": "user", "content": "Thanks."}], "oc")
    assert usage(third)["branch"] == "main"
    assert usage(third)["reused_tokens"] >= second.usage.prompt_tokens + second.usage.completion_tokens - 1
    stats = session_stats(default_url, "oc")
    assert stats is not None and len(stats["branches"]) == 3


def test_an_agent_loop_continues_its_branch_when_the_client_rewrites_its_last_tool_call(
    default_url: str,
) -> None:
    """opencode-shaped: one user message, then tool calls and their results; the client echoes each call
    with its arguments serialised its own way (not as the server stored them), so every request departs
    from the history near its end, inside the turn that began with the last user message: the branch is
    continued in place (no new branch per request) and all but the rewritten call is reused."""
    c = client(default_url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + "Use the tools. " * 30},
        {"role": "user", "content": "Find the bug in parser.py and fix it."},
    ]
    before = ask(c, messages, "loop")
    for step in range(5):
        arguments = json.dumps({"path": f"src/file_{step}.py"}, indent=1)  # not the server's serialisation
        function = {"name": "read", "arguments": arguments}
        call = {"id": f"call_{step}", "type": "function", "function": function}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{step}", "content": f"line {step}: x = 1"})
        reply = ask(c, messages, "loop")
        assert usage(reply)["branch"] == "main", f"step {step} opened {usage(reply)['branch']}"
        assert usage(reply)["reused_tokens"] >= before.usage.prompt_tokens - 1
        before = reply
    stats = session_stats(default_url, "loop")
    assert stats is not None and [b["name"] for b in stats["branches"]] == ["main"]


def test_rejected_requests_leave_no_session(default_url: str) -> None:
    bad = [
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
    ]
    for i, body in enumerate(bad):
        r = httpx.post(f"{default_url}/chat/completions", json=body, headers={"X-Session-Id": f"rej-{i}"})
        assert r.status_code in (400, 404)
        assert session_stats(default_url, f"rej-{i}") is None


def test_one_log_line_per_request(default_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvos.server"):
        ask(client(default_url), [{"role": "user", "content": "hello"}], "logged")
        list(ask(client(default_url), [{"role": "user", "content": "hello"}], "streamed", stream=True))
        httpx.post(f"{default_url}/chat/completions", json={"model": "gpt-9", "messages": []})
    lines = [r.getMessage() for r in caplog.records if r.name == "kvos.server"]
    for sid in ("logged", "streamed"):
        served = [line for line in lines if f"session={sid}" in line]
        assert len(served) == 1
        assert re.search(
            r"POST /v1/chat/completions 200 key=local session=\S+ branch=main prompt=\d+ "
            r"reused=\d+ decoded=\d+ completion=\d+ evictions=\d+ recoveries=\d+ \d+ ms",
            served[0],
        )
    assert any("POST /v1/chat/completions 400" in line for line in lines)


def test_max_tokens_past_the_room_is_clipped() -> None:
    with running_server(MODEL_DIR, "--position-mode", "sparse", budget=512) as url:
        content = "Tell me everything. " * 40
        r = ask(client(url), [{"role": "user", "content": content}], "room", max_tokens=4000)
        clipped = usage(r)["max_tokens_clipped"]
        assert clipped["requested"] == 4000
        assert clipped["granted"] <= 512 and r.usage.completion_tokens <= clipped["granted"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("case", ["out of range", "in use"])
def test_bad_port_is_one_line(case: str) -> None:
    holder = socket.socket()
    port = 99999
    if case == "in use":
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kvos.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.close()
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    message = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(message) == 1, run.stderr
    assert ("outside 1-65535" if case == "out of range" else "already in use") in run.stderr


def test_branches_are_limited_least_recently_used_first() -> None:
    with running_server(MODEL_DIR, "--max-branches", "2") as url:
        c = client(url)
        user = {"role": "user", "content": "Hello there."}
        systems = [{"role": "system", "content": f"You are assistant number {i}."} for i in range(3)]
        first = ask(c, [systems[0], user], "few")
        history = first.usage.prompt_tokens + first.usage.completion_tokens
        ask(c, [systems[1], user], "few")  # a second branch
        again = ask(
            c, [systems[0], user, {"role": "assistant", "content": first.choices[0].message.content}], "few"
        )
        assert usage(again)["reused_tokens"] >= history - 1  # the first branch, used last, is kept...
        ask(c, [systems[2], user], "few")  # ...when a third one pushes the second out
        stats = session_stats(url, "few")
        assert stats is not None and len(stats["branches"]) == 2
        back = ask(c, [systems[1], user], "few")
        assert usage(back)["reused_tokens"] < back.usage.prompt_tokens // 2  # the second branch was dropped


def test_one_branch_continues_in_place() -> None:
    with running_server(MODEL_DIR, "--max-branches", "1") as url:
        c = client(url)
        user = {"role": "user", "content": "Hello there."}
        for i in range(3):
            r = ask(c, [{"role": "system", "content": f"You are assistant number {i}."}, user], "one")
            assert usage(r)["branch"] == "main" and r.usage.completion_tokens > 0
        stats = session_stats(url, "one")
        assert stats is not None and len(stats["branches"]) == 1


def test_models_give_the_context_and_the_budget(default_url: str) -> None:
    """What a client sizes its prompts by: the model's positions (under the names OpenRouter, LM Studio and
    vLLM use) and, in ``kvos``, the session budget and the longest prompt accepted."""
    [entry] = httpx.get(f"{default_url}/models", timeout=30).json()["data"]
    assert entry["id"] == MODEL_NAME
    assert entry["context_length"] == entry["max_model_len"] == CONTEXT
    assert entry["kvos"] == {
        "budget_tokens": 768,
        "max_prompt_tokens": 1 << 20,
        "aliases": [],
    }  # kvos serve's defaults


def test_the_reference_systems_session_header_is_an_alias(default_url: str) -> None:
    """Harnesses written for the reference system send X-EVOKE-Session: it names the session as X-Session-Id
    does (the listing shows it, the next turn reuses it), and X-Session-Id wins when both come."""
    c = client(default_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Remember the blue door."}]
    first = c.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        extra_headers={"X-EVOKE-Session": "evoke-1"},
    )
    assert usage(first)["session_id"] == "evoke-1" and session_stats(default_url, "evoke-1") is not None
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Which door?"},
    ]
    second = ask(c, messages, "evoke-1")  # the same session under X-Session-Id
    assert usage(second)["reused_tokens"] >= first.usage.total_tokens - 1  # type: ignore[union-attr]
    both = c.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_headers={"X-Session-Id": "plain-1", "X-EVOKE-Session": "evoke-1"},
    )
    assert usage(both)["session_id"] == "plain-1"
    bad = httpx.post(
        f"{default_url}/chat/completions",
        json={"model": MODEL_NAME, "messages": messages},
        headers={"X-EVOKE-Session": "no spaces allowed"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
