"""The "lexical" signal: IDF-weighted token overlap of a chunk with the new message."""

from __future__ import annotations

import torch

from kvos.policy.lexical import overlap
from kvos.session.recovery.base import RecoverySignal, Similarity
from kvos.session.units import Unit


class Lexical(RecoverySignal):
    """A chunk scores the share of the new message's IDF mass (over the session's chunks) among its distinct
    tokens: no forward pass. 0.1 by default, measured on the recall benchmark."""

    name = "lexical"
    bar = 0.1

    def similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Similarity:
        return lexical_similarity(self, ids)


def lexical_similarity(signal: RecoverySignal, ids: list[int]) -> Similarity:
    """The lexical score of a chunk of ``signal``'s session against the new message ``ids``."""
    memory = signal.memory
    weights = memory.lexical_weights(ids)
    return lambda c: overlap(weights, memory.lexicon.tokens(c))
