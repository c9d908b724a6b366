"""The session inspector: ``GET /v1/sessions/{id}`` shows every chunk of a session (where its K/V are, its
score and why, its hints, its last event), ``PATCH /v1/sessions/{id}/chunks/{chunk}`` pins, prefers or
re-prioritises one, and ``GET /v1/sessions/{id}/events`` streams what its memory does as it happens.
Against a real server on the built-in model with its default budget, keys scoped as every other session
route."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME, running_server

from kvos.builtin import MODEL_DIR

KEYS = {"one": {"Authorization": "Bearer key-one"}, "two": {"Authorization": "Bearer key-two"}}
RULES = " ".join(f"Rule {i}: read a file before you edit it and keep each answer short." for i in range(60))


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server(MODEL_DIR, api_keys=["key-one", "key-two"]) as u:
        yield u


def chat(url: str, sid: str, messages: list[dict[str, Any]], key: str = "one") -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(
        f"{url}/chat/completions", json=body, headers={**KEYS[key], "X-Session-Id": sid}, timeout=300
    )
    r.raise_for_status()
    reply: dict[str, Any] = r.json()
    return reply


def conversation(url: str, sid: str, turns: int, key: str = "one") -> list[dict[str, Any]]:
    """A session past its budget: a long system prompt, then ``turns`` short exchanges."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are a coding agent. {RULES}"}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Note {i}: my favourite number is {40 + i}."})
        reply = chat(url, sid, messages, key)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return messages


def inspect(url: str, sid: str, key: str = "one", **params: Any) -> httpx.Response:
    return httpx.get(f"{url}/sessions/{sid}", headers=KEYS[key], params=params, timeout=60)


def patch(url: str, sid: str, chunk: int | str, body: Any, key: str = "one") -> httpx.Response:
    return httpx.patch(f"{url}/sessions/{sid}/chunks/{chunk}", json=body, headers=KEYS[key], timeout=300)


def watch(path: str, last: str) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """Read the event stream at ``path`` (key one's) on a thread until an event named ``last``; returns the
    thread, started and connected (the stream's opening comment arrived), and the list it fills."""
    events: list[dict[str, Any]] = []
    connected = threading.Event()

    def read() -> None:
        with httpx.stream("GET", path, headers=KEYS["one"], timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                connected.set()  # the first line is a comment sent once the watch is in place
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
                    if events[-1]["event"] == last:
                        return

    reader = threading.Thread(target=read)
    reader.start()
    assert connected.wait(30)
    return reader, events


def test_every_chunk_is_shown_where_its_kv_are(url: str) -> None:
    conversation(url, "map", 3)
    r = inspect(url, "map")
    assert r.status_code == 200
    s = r.json()
    chunks = s["chunks"]
    assert (
        s["object"] == "session" and s["branch"] == "main" and [b["name"] for b in s["branches"]] == ["main"]
    )
    assert [c["start"] for c in chunks] == [0, *(c["end"] for c in chunks[:-1])]  # they tile the history
    assert chunks[-1]["end"] == s["history_tokens"] == sum(c["tokens"] for c in chunks)
    resident = [c for c in chunks if c["state"] == "resident"]
    assert sum(c["tokens"] for c in resident) == s["active_tokens"] <= s["budget"]
    per_token = 2048  # the built-in model's K/V bytes per token (4 layers, 2 KV heads of 64, float16)
    assert (
        s["active_tokens"] * per_token
        <= s["resident_bytes"]
        <= (s["active_tokens"] + 16 * len(resident)) * per_token
    )
    assert s["saved_ram_bytes"] == sum(c["tokens"] for c in chunks if c["state"] == "saved") * per_token
    assert {c["state"] for c in chunks} == {"resident", "saved"}  # past its budget: some were paged out
    assert all(isinstance(c["position"], int) for c in resident)
    assert all(c["position"] is None for c in chunks if c["state"] != "resident")
    assert all(0.0 <= c["score"] <= 1.0 and set(c["signals"]) >= {"recency", "attention"} for c in chunks)
    assert all(len(c["text"]) <= 160 for c in chunks) and "coding agent" in chunks[0]["text"]
    evicted = [c for c in chunks if c["state"] == "saved"]
    assert all(c["last_event"]["event"] == "evict" for c in evicted)
    assert any(e["event"] == "evict" for e in s["events"]) and len(s["events"]) <= 50
    assert len(inspect(url, "map", events=3).json()["events"]) == 3
    assert inspect(url, "map", events=0).json()["events"] == []


def test_a_pinned_chunk_comes_back_and_stays(url: str) -> None:
    messages = conversation(url, "pin", 3)
    chunks = inspect(url, "pin").json()["chunks"]
    target = next(c for c in chunks if c["state"] == "saved")
    r = patch(url, "pin", target["id"], {"keep": "pin"})
    assert r.status_code == 200, r.text
    assert r.json()["keep"] == "pin" and r.json()["state"] == "resident"  # restored at once
    messages.append({"role": "user", "content": "And another note: the sky is green. " * 40})
    reply = chat(url, "pin", messages)  # more tokens than the budget leaves: evictions, not of the pinned one
    assert reply["usage"]["kvos"]["evictions"] > 0
    after = {c["id"]: c for c in inspect(url, "pin").json()["chunks"]}
    assert after[target["id"]]["state"] == "resident" and after[target["id"]]["keep"] == "pin"
    assert after[target["id"]]["score"] == 1.0
    r = patch(url, "pin", target["id"], {"keep": None, "priority": 0.5})
    assert r.status_code == 200 and r.json()["keep"] is None and r.json()["priority"] == 0.5
    r = patch(url, "pin", target["id"], {"priority": 2.0})  # keep left out: unchanged
    assert r.json()["keep"] is None and r.json()["priority"] == 2.0


def test_pinning_past_the_budget_is_refused_and_changes_nothing(url: str) -> None:
    conversation(url, "greedy", 3)
    chunks = inspect(url, "greedy").json()["chunks"]
    refused = None
    for c in chunks:
        r = patch(url, "greedy", c["id"], {"keep": "pin"})
        if r.status_code != 200:
            refused = (c["id"], r)
            break
    assert refused is not None, "every chunk pinned: the budget should refuse before that"
    cid, r = refused
    assert r.status_code == 400 and r.json()["error"]["code"] == "budget_exceeded"
    assert next(c for c in inspect(url, "greedy").json()["chunks"] if c["id"] == cid)["keep"] is None


@pytest.mark.parametrize(
    ("chunk", "body", "status", "code"),
    [
        (0, {"priority": 0}, 400, None),
        (0, {"priority": 101}, 400, None),
        (0, {"keep": "forever"}, 400, None),
        (0, {"pinned": True}, 400, None),  # an unknown field
        (0, ["pin"], 400, None),
        (999_999, {"keep": "pin"}, 404, "chunk_not_found"),
        ("first", {"keep": "pin"}, 400, None),
    ],
)
def test_bad_hints_are_typed_errors(
    url: str, chunk: int | str, body: Any, status: int, code: str | None
) -> None:
    if inspect(url, "bad").status_code == 404:
        conversation(url, "bad", 1)
    before = inspect(url, "bad").json()["chunks"]
    r = patch(url, "bad", chunk, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    assert inspect(url, "bad").json()["chunks"] == before


def test_another_keys_session_is_not_found_on_every_route(url: str) -> None:
    conversation(url, "private", 1)
    for r in (
        inspect(url, "private", key="two"),
        patch(url, "private", 0, {"keep": "pin"}, key="two"),
        inspect(url, "nobody"),
        httpx.get(f"{url}/sessions/private/events", headers=KEYS["two"]),
    ):
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert inspect(url, "private", branch="b9").json()["error"]["code"] == "branch_not_found"
    other = httpx.get(f"{url}/sessions/private?owner=key-one", headers=KEYS["two"])
    assert other.status_code == 403  # naming another owner needs an admin key


def test_events_stream_what_the_memory_does_as_it_happens(url: str) -> None:
    messages = conversation(url, "watched", 1)
    reader, events = watch(f"{url}/sessions/watched/events", "request")
    messages.append({"role": "user", "content": "Now a long note to page things out. " * 20})
    reply = chat(url, "watched", messages)
    reader.join(120)
    assert not reader.is_alive()
    request = events[-1]
    assert request["event"] == "request" and request["branch"] == "main"
    evictions = [e for e in events if e["event"] == "evict"]
    assert request["evictions"] == reply["usage"]["kvos"]["evictions"] == len(evictions) > 0
    assert all(isinstance(e["chunk"], int) and e["branch"] == "main" for e in evictions)
    assert request["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert request["reused_tokens"] == reply["usage"]["kvos"]["reused_tokens"]


def test_the_keys_event_stream_covers_its_sessions_and_no_others(url: str) -> None:
    """``GET /v1/events``: one stream of every session of the key, each event with its session, sessions
    opening and closing among them; another key's sessions are not in it."""
    reader, events = watch(f"{url}/events", "close")
    conversation(url, "stranger", 1, key="two")
    conversation(url, "wide-a", 1)
    conversation(url, "wide-b", 1)
    assert httpx.delete(f"{url}/sessions/wide-a", headers=KEYS["one"], timeout=60).status_code == 200
    reader.join(120)
    assert not reader.is_alive()
    mine = {s["id"] for s in httpx.get(f"{url}/sessions", headers=KEYS["one"]).json()["data"]}
    seen = {e["session"] for e in events}  # others of key one's sessions may feel the pool's pressure
    assert {"wide-a", "wide-b"} <= seen <= mine | {"wide-a"} and "stranger" not in seen
    assert next(e["event"] for e in events if e["session"] == "wide-a") == "open"
    assert events[-1] == {"event": "close", "reason": "deleted", "session": "wide-a"}
    requests = [e for e in events if e["event"] == "request"]
    assert [e["session"] for e in requests] == ["wide-a", "wide-b"]
    assert httpx.get(f"{url}/events").status_code == 401  # keys are required here as on every /v1 route


def test_the_pool_and_the_keys_requirement_are_public_facts(url: str) -> None:
    root = url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json()["keys_required"] is True
    listing = httpx.get(f"{url}/sessions", headers=KEYS["one"], timeout=60).json()
    pool = listing["pool"]
    assert 0 < pool["live_bytes"] <= pool["bytes"] and pool["max_bytes"] is None
    assert pool["tokens"] % pool["block_tokens"] == 0 and pool["live_tokens"] <= pool["tokens"]


def test_the_memory_map_is_served_without_a_key(url: str) -> None:
    root = url.removesuffix("/v1")
    page = httpx.get(f"{root}/ui", follow_redirects=True)
    assert page.status_code == 200 and "kvos memory map" in page.text
    for asset, kind in (("ui.js", "javascript"), ("ui.css", "text/css")):
        r = httpx.get(f"{root}/ui/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 1000
    assert httpx.get(f"{root}/ui/nothing.js").status_code == 404
