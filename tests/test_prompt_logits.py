"""A prompt's chunks run the output head once: only the pass over the prompt's last token computes logits (the
ones a reply starts from), and a re-sync that needs none (the server's canonical reply) computes none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from session_parts import small_chunks_manager, tokens

from kvos.policy.chunks import ChunkKind
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span, flatten

TOL = 1e-4
VOCAB = 300  # the small model's (conftest.SMALL)


@pytest.fixture
def manager(model_dir: Path) -> MemoryManager:
    return small_chunks_manager(model_dir)


def _prompt() -> list[Span]:
    """A system-like document (30 tokens: two chunks of 24), a user message (50: three chunks), a reply's
    header (4)."""
    return [
        Span(tokens(1, 30, VOCAB), ChunkKind.DOCUMENT, message_index=0),
        Span(tokens(2, 50, VOCAB), ChunkKind.USER, message_index=1),
        Span(tokens(3, 4, VOCAB), ChunkKind.ASSISTANT, message_index=2),
    ]


def _asked(manager: MemoryManager, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that gets the ``logits`` each forward pass of ``manager``'s model asks for, from now on."""
    model, asked = manager.engine.model, []
    real = model.forward_batch

    def spy(items: list, kv: object) -> list[torch.Tensor]:  # type: ignore[type-arg]
        asked.extend(item.logits for item in items)
        return real(items, kv)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "forward_batch", spy)
    return asked


def _one_pass(manager: MemoryManager, ids: list[int]) -> torch.Tensor:
    seq = manager.engine.new_sequence()
    try:
        return manager.engine.extend(seq, ids)
    finally:
        seq.release()


def test_only_the_prompts_last_pass_runs_the_head(
    manager: MemoryManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six chunks: five passes without logits, the last with its last token's; those logits are the prompt's
    (one unsliced pass gives the same within float32 rounding)."""
    session = manager.session("a")
    asked = _asked(manager, monkeypatch)
    result = session.sync(_prompt())
    assert result.decoded == 84 and asked == ["none"] * 5 + ["last"]
    assert session.last_logits is not None and session.logits_at == 84
    monkeypatch.undo()
    expected = _one_pass(manager, flatten(_prompt()))
    assert (session.last_logits - expected).abs().max().item() <= TOL


def test_a_sync_that_needs_no_logits_runs_no_head_and_leaves_none(
    manager: MemoryManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``need_logits=False``: no pass computes logits and the session keeps none (no stale ones from an
    earlier prompt); syncing the same prompt for a reply then decodes its last token again, and only that
    pass runs the head."""
    session = manager.session("b")
    session.sync([Span(tokens(4, 10, VOCAB), ChunkKind.USER, message_index=0)])
    assert session.last_logits is not None
    asked = _asked(manager, monkeypatch)
    session.sync(
        [Span(tokens(4, 10, VOCAB), ChunkKind.USER, message_index=0), *_prompt()[1:]], need_logits=False
    )
    assert asked == ["none"] * 4 and session.last_logits is None
    asked.clear()
    again = session.sync([Span(tokens(4, 10, VOCAB), ChunkKind.USER, message_index=0), *_prompt()[1:]])
    assert (again.reused, again.decoded) == (63, 1) and asked == ["last"]
    monkeypatch.undo()
    expected = _one_pass(manager, tokens(4, 10, VOCAB) + tokens(2, 50, VOCAB) + tokens(3, 4, VOCAB))
    assert session.last_logits is not None
    assert (session.last_logits - expected).abs().max().item() <= TOL
