"""A deleted session's memory is reclaimed (a full garbage collection, then ``malloc_trim``) without stopping
the other sessions' streams: the collection holds the interpreter lock for ~140 ms with SmolLM2 loaded, so
while another session runs under the scheduler it waits for the scheduler to run out of work; on an idle
server it runs before the delete returns, as before (:meth:`kvos.server.registry.SessionRegistry._reclaim`).
The server is ``kvos serve``'s own app, with its defaults, on the built-in model."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME, running_app

from kvos.builtin import MODEL_DIR
from kvos.model.tokenizer import load_tokenizer
from kvos.server import registry

NEVER_END = {str(t): -100 for t in load_tokenizer(MODEL_DIR).eos_ids}


def _chat(url: str, session: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me about the sea and every wave in it."}],
        "max_tokens": 400 if stream else 8,
        "temperature": 0,
        "logit_bias": NEVER_END,  # a reply that runs to max_tokens
        "stream": stream,
    }
    request = httpx.Request("POST", f"{url}/chat/completions", json=body, headers={"X-Session-Id": session})
    return httpx.Client(timeout=120).send(request, stream=stream)


def test_a_delete_beside_a_stream_reclaims_once_the_stream_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    with running_app(MODEL_DIR) as (url, app):
        entries = app.state.service.registry.entries
        model = app.state.service.manager.engine.model
        forward = model.forward_batch

        def step_of_a_real_model(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.005)  # the built-in model's steps take ~0.2 ms: its reply would be over at once
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward_batch", step_of_a_real_model)
        reclaims: list[bool] = []  # whether a session was busy at each reclaim
        monkeypatch.setattr(
            registry, "reclaim_memory", lambda: reclaims.append(any(e.busy for e in entries.values()))
        )
        assert _chat(url, "gone").status_code == 200
        stream = _chat(url, "running", stream=True)
        events = (line for line in stream.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        r = httpx.delete(f"{url}/sessions/gone", timeout=60)
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert reclaims == []  # the other session streams on
        rest = list(events)
        stream.close()
        assert rest[-1] == "data: [DONE]" and len(rest) > 20
        deadline = time.monotonic() + 10
        while not reclaims:
            assert time.monotonic() < deadline, "the deleted session's memory was never reclaimed"
            time.sleep(0.01)
        assert reclaims == [False]  # once, with no session running
        # on the idle server the delete reclaims before it answers
        r = httpx.delete(f"{url}/sessions/running", timeout=60)
        assert r.status_code == 200 and reclaims == [False, False]


def test_under_a_load_that_never_pauses_the_reclaim_waits_at_most_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's hook after every step's turns reclaims what has waited ``RECLAIM_WAIT_S``."""
    with running_app(MODEL_DIR) as (_, app):
        sessions = app.state.service.registry
        reclaims: list[float] = []
        monkeypatch.setattr(registry, "reclaim_memory", lambda: reclaims.append(time.monotonic()))
        sessions._reclaim_due = time.monotonic() - registry.RECLAIM_WAIT_S + 5
        sessions.reclaim_if_due(registry.RECLAIM_WAIT_S)
        assert reclaims == []
        sessions._reclaim_due = time.monotonic() - registry.RECLAIM_WAIT_S - 1
        sessions.reclaim_if_due(registry.RECLAIM_WAIT_S)
        sessions.reclaim_if_due(registry.RECLAIM_WAIT_S)
        assert len(reclaims) == 1 and sessions._reclaim_due is None
