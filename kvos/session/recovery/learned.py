"""The "learned" signal: the model's own layer-0 queries of the new message against the chunks' keys,
through a calibrated :class:`~kvos.policy.retriever.Retriever`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvos.policy.retriever import Retriever
from kvos.session.recovery.base import RecoverySignal, Similarity
from kvos.session.units import Unit

if TYPE_CHECKING:
    from kvos.session.memory import SessionMemory


class Learned(RecoverySignal):
    """A chunk scores the retriever's combination of its key code against the new message's projected
    queries with its lexical score: no forward pass. The bar is the retriever's calibrated threshold."""

    name = "learned"
    exchanges = True
    needs_retriever = True

    @classmethod
    def default_bar(cls, retriever: Retriever | None) -> float:
        assert retriever is not None
        return retriever.threshold

    def similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Similarity:
        learned = self.scores(ids)
        return lambda c: learned.get(c.chunk_id)

    def scores(self, ids: list[int]) -> dict[int, float]:
        """Chunk id -> score of every candidate chunk for the new message ``ids`` (:func:`learned_scores`)."""
        return learned_scores(self.memory, ids)


def learned_scores(memory: SessionMemory, ids: list[int]) -> dict[int, float]:
    """Chunk id -> :class:`Retriever` score of every candidate chunk of ``memory``'s session
    (:meth:`~kvos.session.memory.SessionMemory.learned_candidates`) for the new message ``ids``: its last
    ``query_window`` tokens' projected layer-0 queries come from the retriever's per-token table."""
    retriever = memory.config.retriever
    assert retriever is not None
    with torch.no_grad():
        chunks, codes, lexical = memory.learned_candidates(ids)
        if not chunks:
            return {}
        window = ids[-memory.config.query_window :]
        queries = retriever.token_queries(memory.pager.engine.model, window)
        scores = retriever.combine(retriever.scores(queries, codes), torch.tensor(lexical))
    return dict(zip((c.chunk_id for c in chunks), scores.tolist(), strict=True))
