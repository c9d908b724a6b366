"""``kvos serve`` on a hybrid model (Qwen3.5), as a client uses it: with its defaults (a float16 pool, the
scheduler batching sessions), several conversations at once, a client that edits an earlier reply, a
cancelled stream. Every greedy reply must equal the reply a session given the same messages from scratch
gets, whatever the first session's recurrent state went through (reuse, checkpoints, truncation).
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from hf_models import build
from server_harness import MODEL_NAME, running_app
from session_parts import chat, text, with_builtin_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build(
        "qwen3.5",
        tmp_path_factory.mktemp("qwen35chat"),
        seed=6,
        vocab_size=2048,
        num_hidden_layers=8,
        max_position_embeddings=1024,
    )
    return with_builtin_tokenizer(path)


def test_concurrent_conversations_with_an_edited_reply_answer_as_fresh_sessions(model_dir: Path) -> None:
    with running_app(model_dir) as (url, _):
        results: dict[int, list[tuple[list[dict[str, str]], str, int]]] = {}

        def converse(client: int) -> None:
            messages = [{"role": "user", "content": f"client {client} asks about lanterns and crates"}]
            turns = []
            for turn in range(3):
                reply = chat(url, f"c{client}", messages)
                turns.append((list(messages), text(reply), reply["usage"]["kvos"]["reused_tokens"]))
                answer = text(reply) if turn != 1 else "an answer the client rewrote " + text(reply)[:5]
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"turn {turn}: and then? " * (turn + 1)},
                ]
            results[client] = turns

        threads = [threading.Thread(target=converse, args=(c,)) for c in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [0, 1, 2]
        for client, turns in results.items():
            assert turns[1][2] > 0  # turn 2 reused the cache of turn 1
            for turn, (messages, got, _) in enumerate(turns):
                fresh = chat(url, f"fresh-{client}-{turn}", messages)
                assert text(fresh) == got, (client, turn)
        for client in results:  # the edited reply cut the history: a truncation, or a branch of its own
            detail = httpx.get(f"{url}/sessions/c{client}", params={"events": 1000}, timeout=30).json()
            assert any(e["event"] == "truncate" for e in detail["events"]) or len(detail["branches"]) > 1


def test_a_cancelled_stream_leaves_the_session_answering_as_a_fresh_one(model_dir: Path) -> None:
    with running_app(model_dir) as (url, _):
        messages = [{"role": "user", "content": "tell me a long story about the sea and the lighthouse"}]
        body = {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": 200,
            "stream": True,
            "temperature": 0,
        }
        with httpx.stream(
            "POST", f"{url}/chat/completions", json=body, headers={"X-Session-Id": "s"}, timeout=120
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:  # a few tokens in, the client goes away
                    break
        follow = [*messages, {"role": "assistant", "content": "Once"}, {"role": "user", "content": "go on"}]
        got = chat(url, "s", follow)
        assert text(got) == text(chat(url, "fresh", follow))


def test_the_checkpoints_a_session_keeps_follow_the_option(model_dir: Path) -> None:
    with running_app(model_dir, "--recurrent-checkpoints", "1") as (url, app):
        manager = app.state.service.manager
        assert manager.config.recurrent_checkpoints == 1
        chat(url, "s", [{"role": "user", "content": "count the lanterns in every crate " * 40}])
        (session,) = manager.sessions.values()
        assert session.history.tokens > 3 * 128  # several chunk boundaries passed, one checkpoint kept
        assert len(session.checkpoints.entries) == 1
        metrics = httpx.get(url.replace("/v1", "/metrics"), timeout=30).text
        line = next(m for m in metrics.splitlines() if m.startswith("kvos_session_recurrent_bytes{"))
        assert float(line.split()[-1]) == session.stats()["recurrent_bytes"] > 0
