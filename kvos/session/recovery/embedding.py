"""The "embedding" signal: the cosine of a chunk's embedding with the new message's."""

from __future__ import annotations

import torch

from kvos.policy.chunks import Chunk
from kvos.policy.signals import cosine
from kvos.session.recovery.base import RecoverySignal, Similarity
from kvos.session.units import Unit


class Embedding(RecoverySignal):
    """A chunk scores the cosine of its embedding (the session's embedder, computed when first needed) with
    the new message's; a chunk without one is no candidate. 0.2 by default."""

    name = "embedding"
    bar = 0.2

    def similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Similarity:
        def score(chunk: Chunk) -> float | None:
            embedding = self.memory.embedding_of(chunk)
            return None if embedding is None else cosine(query, embedding)

        return score
