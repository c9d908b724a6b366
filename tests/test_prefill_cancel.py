"""A request cancelled while its prompt is prefilled (the client went away, or DELETE, during an agent's
long first request) stops at the next chunk boundary instead of prefilling the rest: the chunks already
prefilled stay (a prefix of the prompt), and the retry reuses them and answers as an uncancelled request
does. On ``kvos serve``'s own defaults (built-in model, default budget and chunk size)."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import httpx
import pytest
from server_harness import running_app, serve_options

from kvos.bench.session import WORDS
from kvos.builtin import MODEL_DIR
from kvos.errors import PrefillCancelled
from kvos.server.lifecycle import Cancelled, drain
from kvos.server.main import build_service
from kvos.server.schemas import ChatRequest
from kvos.server.service import ChatService
from kvos.session.prompt import flatten
from kvos.session.session import Session

PREFILLED_BEFORE_CANCEL = 2  # chunks


def _request(service: ChatService) -> ChatRequest:
    rng = random.Random(5)
    text = " ".join(rng.choice(WORDS) for _ in range(300))  # several chunks of the default size
    messages = [{"role": "system", "content": "Keep the notes."}, {"role": "user", "content": text}]
    body = {"model": service.config.model_name, "messages": messages, "max_tokens": 8, "temperature": 0}
    return ChatRequest.model_validate(body)


def _answer(service: ChatService, session_id: str) -> tuple[list[int], dict[str, Any]]:
    entry = service.registry.acquire("local", session_id, None)
    try:
        req = _request(service)
        outcome = drain(service.run(entry, service.prepare_chat(entry, req), req, req), entry.cancel)
        return outcome.completion_ids, dict(outcome.usage["kvos"])
    finally:
        service.registry.release(entry)


def test_cancel_during_prefill_stops_at_a_chunk_and_the_retry_reuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = build_service(serve_options(["--model", str(MODEL_DIR)]))
    expected, _ = _answer(service, "control")  # the same request, never cancelled
    service.registry.delete("local", "control")  # else "cut" would take its prompt from it, not prefill it

    entry = service.registry.acquire("local", "cut", None)
    req = _request(service)
    spans = service.prepare_chat(entry, req)
    prompt = flatten(spans)
    prefill = Session._prefill
    calls: list[int] = []

    def prefill_then_cancel(session: Session, *args: Any, **kwargs: Any) -> None:
        prefill(session, *args, **kwargs)
        calls.append(session.history.tokens)
        if len(calls) == PREFILLED_BEFORE_CANCEL:
            entry.cancel.set()  # the client goes away while the prompt is prefilled

    monkeypatch.setattr(Session, "_prefill", prefill_then_cancel)
    with pytest.raises(Cancelled) as caught:
        drain(service.run(entry, spans, req, req), threading.Event())  # only the entry's flag is set
    monkeypatch.undo()
    assert isinstance(caught.value.__cause__, PrefillCancelled)
    session = entry.session
    chunk_tokens = session.config.chunk_tokens
    kept = session.history.token_ids()
    assert len(calls) == PREFILLED_BEFORE_CANCEL  # no chunk was prefilled after the flag
    assert 0 < len(kept) <= PREFILLED_BEFORE_CANCEL * chunk_tokens < len(prompt)
    assert kept == prompt[: len(kept)]  # what stays is a prefix of the prompt
    assert session.memory.journal.counts["cancel"] == 1
    service.registry.release(entry)

    retried, usage = _answer(service, "cut")
    assert usage["reused_tokens"] == len(kept)
    assert usage["decoded_tokens"] == len(prompt) - len(kept) + len(retried)
    assert retried == expected  # greedy: the same reply as the request that was never cancelled


@pytest.mark.parametrize("stream", [True, False])
def test_cancelled_prefill_over_http_is_a_cancel_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Through ``kvos serve``'s HTTP layer: a stream gets the 'cancelled' error event and [DONE] (not a 500),
    a plain request is answered 499, and the session is free for the next request."""
    prefill = Session._prefill

    def prefill_then_cancel(session: Session, *args: Any, **kwargs: Any) -> None:
        prefill(session, *args, **kwargs)
        if session.cancel is not None and session.history.tokens > 0:
            session.cancel.set()  # as DELETE or a client going away does, during the prompt's prefill

    with running_app(MODEL_DIR) as (url, app):
        service: ChatService = app.state.service
        body = _request(service).model_dump(exclude_none=True) | {"stream": stream}
        monkeypatch.setattr(Session, "_prefill", prefill_then_cancel)
        r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": "cut"}, timeout=60)
        monkeypatch.undo()
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "cancelled"
        else:
            assert r.status_code == 499 and r.json()["error"]["code"] == "client_closed"
        again = httpx.post(
            f"{url}/chat/completions",
            json=body | {"stream": False},
            headers={"X-Session-Id": "cut"},
            timeout=60,
        )
        assert again.status_code == 200
        assert again.json()["usage"]["kvos"]["reused_tokens"] > 0  # the prefilled chunks stayed
