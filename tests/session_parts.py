"""What session and server tests build conversations from: seeded token runs, document spans, a tiny model
with the built-in tokenizer beside it, and one chat request by session id."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import torch
from server_harness import MODEL_NAME

from kvos.engine.engine import Engine
from kvos.memory.store import ChunkStore
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkKind
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span

BUILTIN = Path(__file__).resolve().parents[1] / "kvos" / "builtin" / "model"


def with_builtin_tokenizer(path: Path) -> Path:
    """``path`` (a model directory) with the built-in model's tokenizer and chat template copied beside it."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, path / name)
    return path


def small_chunks_manager(
    model_dir: Path,
    budget: int = 4096,
    store_dir: Path | None = None,
    mode: str = "compact",
    **engine: Any,
) -> MemoryManager:
    """Sessions of a float32 model in chunks of 24 tokens on blocks of 8, held to ``budget`` exactly,
    recovering by words; with ``store_dir``, a store that writes every saved chunk through to it (a
    restart's files). ``engine``: more :class:`Engine` arguments (``window_margin``)."""
    config = SessionConfig(
        budget=Budget(max_active_tokens=budget, policy="hard"),
        chunk_tokens=24,
        embedder="tokens",
        recovery_signal="lexical",
        position_mode=mode,  # type: ignore[arg-type]
    )
    factory = None if store_dir is None else (lambda sid: ChunkStore(1 << 30, store_dir, write_through=True))
    runtime = Engine(load_model(model_dir, dtype="float32"), block_size=8, **engine)
    return MemoryManager(runtime, load_tokenizer(model_dir), config, store_factory=factory)


def tokens(seed: int, n: int, high: int = 2000) -> list[int]:
    """``n`` seeded token ids in [3, high)."""
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def spans(*parts: list[int]) -> list[Span]:
    """Each part a document span of its own message."""
    return [Span(list(p), ChunkKind.DOCUMENT, message_index=i) for i, p in enumerate(parts)]


def chat(url: str, session: str, messages: list[dict[str, str]], max_tokens: int = 10) -> dict[str, Any]:
    """A greedy chat completion on session ``session`` (``X-Session-Id``); asserts a 200."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=300)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def text(reply: dict[str, Any]) -> str:
    """The reply's message content."""
    return str(reply["choices"][0]["message"]["content"])
