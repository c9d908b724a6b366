"""``kvos serve`` on a model with sliding-window layers (a tiny Gemma 3), as a client uses it: its defaults
(a float16 pool, a window margin of 1,024 tokens, the scheduler batching sessions), conversations long
enough for the window layers to let go of K/V, and a client that rewrites an early reply (a cut past the
margin). Every greedy reply must equal the reply a session given the same messages from scratch gets.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from hf_models import build
from server_harness import running_app
from session_parts import chat, text, with_builtin_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 0 and 2 slide over 16 positions, layer 1 is global."""
    path = build(
        "gemma3",
        tmp_path_factory.mktemp("gemma3chat"),
        seed=7,
        vocab_size=2048,
        sliding_window=16,
        max_position_embeddings=4096,
    )
    return with_builtin_tokenizer(path)


def message(client: int, turn: int) -> str:
    """About 400 tokens: four turns take a conversation well past the window and its margin."""
    return f"client {client} turn {turn}: " + "the lantern crates went north by the river road. " * 40


def test_long_conversations_and_an_early_edit_answer_as_fresh_sessions(model_dir: Path) -> None:
    with running_app(model_dir) as (url, app):
        results: dict[int, list[tuple[list[dict[str, str]], str]]] = {}

        def converse(client: int) -> None:
            messages: list[dict[str, str]] = []
            turns = []
            for turn in range(4):
                messages.append({"role": "user", "content": message(client, turn)})
                reply = chat(url, f"c{client}", messages, max_tokens=8)
                turns.append((list(messages), text(reply)))
                messages.append({"role": "assistant", "content": text(reply)})
            results[client] = turns

        threads = [threading.Thread(target=converse, args=(c,)) for c in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pool = app.state.service.manager.engine.pool
        assert pool.slides and pool.rows.num_used < pool.allocator.num_used  # the window layers let go
        for client, turns in results.items():
            for turn, (messages, got) in enumerate(turns):
                assert text(chat(url, f"fresh-{client}-{turn}", messages, max_tokens=8)) == got, (
                    client,
                    turn,
                )

        # client 0 rewrites its first reply: the cut is ~1,200 tokens back, past the margin
        messages, _ = results[0][-1]
        edited = [messages[0], {"role": "assistant", "content": "a rewritten answer"}, *messages[2:]]
        got = text(chat(url, "c0", edited, max_tokens=8))
        assert got == text(chat(url, "fresh-edit", edited, max_tokens=8))
        detail = httpx.get(f"{url}/sessions/c0", params={"events": 1000}, timeout=30).json()
        assert any(e["event"] == "window_gap" for e in detail["events"]), detail["events"]
        sessions = httpx.get(f"{url}/sessions", timeout=30).json()
        assert 0 < sessions["pool"]["window_live_bytes"] < sessions["pool"]["live_bytes"]
        metrics = httpx.get(url.replace("/v1", "/metrics"), timeout=30).text
        line = next(x for x in metrics.splitlines() if x.startswith("kvos_pool_window_live_bytes "))
        assert float(line.split()[1]) == pool.rows.pool.live_bytes
