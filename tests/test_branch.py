"""Branches: a fork shares its parent's resident K/V by reference and both go on as if alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvos.engine.engine import Engine
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkKind, ChunkState
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span

TOL = 1e-5


@pytest.fixture()
def manager(model_dir: Path) -> MemoryManager:
    config = SessionConfig(
        budget=Budget(max_active_tokens=160, policy="hard"),
        chunk_tokens=24,
        embedder="tokens",
        recovery_signal="lexical",
    )
    return MemoryManager(Engine(load_model(model_dir), block_size=8), load_tokenizer(model_dir), config)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def spans(*parts: list[int]) -> list[Span]:
    return [Span(list(p), ChunkKind.DOCUMENT, message_index=i) for i, p in enumerate(parts)]


def logits_of(manager: MemoryManager, name: str, *parts: list[int]) -> torch.Tensor:
    session = manager.session(name)
    session.sync(spans(*parts))
    assert session.last_logits is not None
    return session.last_logits.clone()


def test_fork_shares_chunks_and_continues_exactly(manager: MemoryManager) -> None:
    head, tail, other = tokens(1, 100), tokens(2, 20), tokens(3, 20)
    parent = manager.session("main")
    parent.sync(spans(head[:60], head[60:]))
    used = manager.engine.pool.allocator.num_used
    child = manager.fork("main", "branch", 50)  # inside the first chunk, not at a pool-block boundary
    assert child.history.tokens == 50 and child.history.token_ids() == head[:50]
    # 50 tokens = 6 full pool blocks shared by reference + one partly filled block copied
    assert manager.engine.pool.allocator.num_used == used + 1
    shared = child.pager.seq.slots[:48].tolist()
    assert shared == parent.pager.seq.slots[:48].tolist()
    assert all(manager.engine.pool.allocator.refcount(s // 8) == 2 for s in shared[::8])
    assert child.pager.seq.slots[48] != parent.pager.seq.slots[48]

    child.sync(spans(head[:50], tail))
    parent.sync(spans(head[:60], head[60:], other))
    torch.testing.assert_close(
        child.last_logits, logits_of(manager, "fresh-a", head[:50], tail), rtol=0, atol=TOL
    )
    torch.testing.assert_close(
        parent.last_logits, logits_of(manager, "fresh-b", head[:60], head[60:], other), rtol=0, atol=TOL
    )


def test_eviction_in_a_branch_leaves_the_parent_intact(manager: MemoryManager) -> None:
    head = tokens(4, 120)
    parent = manager.session("main")
    parent.sync(spans(head))
    before = parent.pager.seq.slots.clone()
    k0, v0 = manager.engine.read_kv(parent.pager.segments[min(parent.pager.segments)])
    child = manager.fork("main", "branch", 120)
    child.sync(spans(head, tokens(5, 90)))  # over the 160-token budget: the branch pages out and compacts
    assert child.memory.journal.count("evict") > 0
    assert child.pager.active_tokens <= 160
    assert torch.equal(parent.pager.seq.slots, before)
    k1, v1 = manager.engine.read_kv(parent.pager.segments[min(parent.pager.segments)])
    assert torch.equal(k0, k1) and torch.equal(v0, v1)  # the branch's re-rotation copied, not moved, keys
    extra = tokens(6, 10)
    parent.sync(spans(head, extra))
    torch.testing.assert_close(parent.last_logits, logits_of(manager, "fresh", head, extra), rtol=0, atol=TOL)


def test_fork_copies_saved_chunks_and_frees_on_close(manager: MemoryManager) -> None:
    parent = manager.session("main")
    parent.sync(spans(*(tokens(10 + i, 40) for i in range(6))))  # 240 tokens > 160: some are saved
    saved = [c for c in parent.chunks.values() if c.state is ChunkState.SAVED]
    assert saved
    child = manager.fork("main", "branch", parent.history.tokens)
    assert child.history.token_ids() == parent.history.token_ids()
    for chunk in saved:
        assert child.chunks[chunk.chunk_id].state is ChunkState.SAVED
        assert child.pager.store is not None and chunk.chunk_id in child.pager.store
    manager.close("main")
    manager.close("branch")
    assert manager.engine.pool.allocator.num_used == 0
