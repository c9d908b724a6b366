"""A new session whose first prompt starts as another session of the same key does (an agent harness's
system prompt and tool schemas, sent under a new ``X-Session-Id`` for each task) takes those tokens' K/V
from it by reference instead of prefilling them again, and answers as a session that prefilled them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from server_harness import MODEL_NAME, running_app, running_server

SYSTEM = "You are a coding agent. " + " ".join(
    f"Tool {i} reads file {i} and reports its lines." for i in range(12)
)


def ask(url: str, sid: str, user: str, key: str | None = None) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 12,
        "temperature": 0,
    }
    headers = {"X-Session-Id": sid, **({"Authorization": f"Bearer {key}"} if key else {})}
    r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def test_a_new_session_reuses_another_sessions_prefix(model_dir: Path) -> None:
    with running_app(model_dir) as (url, app):
        first = ask(url, "task-1", "List the files.")
        assert first["usage"]["kvos"]["reused_tokens"] == 0
        second = ask(url, "task-2", "Count the lines of file 3.")
        reused = second["usage"]["kvos"]["reused_tokens"]
        system_tokens = len(app.state.service.manager.tokenizer.encode(SYSTEM))
        assert reused >= system_tokens >= 64  # the shared start was not prefilled again
        assert (
            second["usage"]["kvos"]["decoded_tokens"] < second["usage"]["prompt_tokens"] - system_tokens + 8
        )
        sessions = {s["id"] for s in httpx.get(f"{url}/sessions", timeout=30).json()["data"]}
        assert sessions == {"task-1", "task-2"}  # two sessions, each its own
        again = ask(url, "task-1", "List the files.")  # the donor is untouched by its fork
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    with running_server(model_dir) as cold:  # a server that prefilled the prefix itself
        alone = ask(cold, "task-2", "Count the lines of file 3.")
        assert alone["usage"]["kvos"]["reused_tokens"] == 0
    assert second["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_another_keys_session_gives_nothing(model_dir: Path) -> None:
    with running_server(model_dir, api_keys=["alice", "bob"]) as url:
        ask(url, "task-1", "List the files.", key="alice")
        other = ask(url, "task-2", "Count the lines of file 3.", key="bob")
        assert other["usage"]["kvos"]["reused_tokens"] == 0
        same = ask(url, "task-3", "Count the lines of file 3.", key="alice")
        assert same["usage"]["kvos"]["reused_tokens"] >= 64
