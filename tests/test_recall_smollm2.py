"""kvos bench recall on a real model (SmolLM2-135M-Instruct, Q4_1 GGUF from ../shared): the sessions are
rendered with the model's own ChatML template; the built-in corpus sized by its context, the knowledge
corpus by default; a CI-sized run writes its rows and --quick plays two short sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvos.bench.recall import auto_fillers
from kvos.builtin.corpus import heldout_sessions
from kvos.builtin.playback import play, session_tokens
from kvos.cli import main
from kvos.engine.engine import Engine
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, load_tokenizer
from kvos.policy.budget import Budget
from kvos.session.manager import MemoryManager
from kvos.session.strategies import strategy

SMOLLM2 = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
ROW = ("strategy", "budget_frac", "pass_rate", "ci_low", "ci_high", "mean_evictions", "mean_recoveries")


@pytest.fixture(scope="module")
def gguf(shared_dir: Path) -> Path:
    return shared_dir / SMOLLM2


@pytest.fixture(scope="module")
def tokenizer(gguf: Path) -> Tokenizer:
    return load_tokenizer(gguf)


def test_sessions_fill_the_context(tokenizer: Tokenizer) -> None:
    """The default session length for a GGUF file uses most of SmolLM2's 8,192 positions, never more."""
    template = ChatTemplate.from_tokenizer(tokenizer)
    fillers = auto_fillers(8192, tokenizer, template, 24)
    sizes = [session_tokens(c, tokenizer, template, 24) for c in heldout_sessions(12, fillers=fillers)]
    assert 0.5 * 8192 < sum(sizes) / len(sizes) < 8192
    assert max(sizes) <= 8192
    for chat in heldout_sessions(12, fillers=fillers):
        assert chat.probes[0].distance >= fillers // 2  # the fact sits in the session's first half


def test_playback_renders_with_the_models_template(gguf: Path, tokenizer: Tokenizer) -> None:
    """What the session holds is the conversation as SmolLM2's ChatML template renders it, token for token."""
    [chat] = heldout_sessions(1, fillers=1)
    manager = MemoryManager(Engine(load_model(gguf, dtype="float32")), tokenizer)
    config = strategy("full", Budget(max_active_tokens=100_000), 64)
    config.embedder = "tokens"  # no extra forward pass per chunk
    session = manager.session(config=config)
    played = play(session, chat, max_tokens=4)
    asked = chat.messages[: chat.probes[0].message_index + 1]
    prompt = ChatTemplate.from_tokenizer(tokenizer).render(asked, add_generation_prompt=True)
    assert prompt.startswith(f"<|im_start|>system\n{asked[0]['content']}<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith(f"{asked[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
    assert session.rendered == prompt + played.reply
    ids = tokenizer.encode(prompt)
    assert session.history.token_ids()[: len(ids)] == ids


def test_recall_bench_ci_sized(gguf: Path, tmp_path: Path) -> None:
    """One short session, one strategy at half the session's size: the JSON rows carry every field."""
    out = tmp_path / "recall.json"
    argv = [
        "bench",
        "recall",
        "--model",
        str(gguf),
        "--dtype",
        "float32",
        "--sessions",
        "1",
        "--fillers",
        "1",
    ]
    argv += ["--budgets", "0.5", "--strategies", "streaming_llm", "--embedder", "tokens", "--max-tokens", "4"]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"benchmark", "model", "device", "torch", "rows"} <= result.keys()
    assert (result["benchmark"], result["model"], result["sessions"], result["fillers"]) == (
        "recall",
        Path(SMOLLM2).name,
        1,
        1,
    )
    [row] = result["rows"]
    assert set(ROW) <= row.keys() and (row["strategy"], row["budget_frac"], row["n"]) == (
        "streaming_llm",
        0.5,
        1,
    )
    assert 0.0 <= row["ci_low"] <= row["pass_rate"] <= row["ci_high"] <= 1.0
    assert row["mean_evictions"] > 0 and row["mean_recoveries"] == 0  # a baseline evicts and never recovers
    assert row["mean_seconds"] > 0 and row["mean_session_tokens"] > 100


def test_recall_bench_quick_plays_few_short_sessions(gguf: Path, tmp_path: Path) -> None:
    """--quick on a GGUF chat model: 2 knowledge sessions of 4 questions (minutes on 2 cores for any model),
    not sessions sized to the context."""
    out = tmp_path / "recall.json"
    argv = ["bench", "recall", "--model", str(gguf), "--quick", "--budgets", "0.5", "--strategies"]
    assert main([*argv, "streaming_llm", "--max-tokens", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["corpus"], result["sessions"], result["fillers"]) == ("knowledge", 2, 4)
    [row] = result["rows"]
    assert row["n"] == 2 and row["mean_session_tokens"] < 700 and row["mean_evictions"] > 0
