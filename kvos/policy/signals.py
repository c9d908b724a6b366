"""The scorer's small signals: recency, coherence to the task focus, recovery strength, source floors.

Each is a pure function returning a value in [0, 1], or ``None`` when the signal is absent (an absent signal
leaves the scorer's weighted mean entirely: numerator and denominator).
"""

from __future__ import annotations

import math

import torch

from kvos.errors import SignalError
from kvos.policy.chunks import ChunkKind


def recency(tokens_since_end: int, rate: float = 0.01) -> float:
    """``exp(-rate * max(0, tokens_since_end))``: 1.0 for the newest chunk, decaying with distance."""
    return math.exp(-rate * max(0, tokens_since_end))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two ``[dim]`` vectors in float32 (0.0 when either has zero norm).

    Raises :class:`SignalError` when the shapes differ.
    """
    if a.shape != b.shape:
        raise SignalError(f"embeddings of different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    a32 = a.detach().reshape(-1).float()
    b32 = b.detach().reshape(-1).float().to(a32.device)
    denom = float(a32.norm() * b32.norm())
    if denom == 0.0:
        return 0.0
    return max(-1.0, min(1.0, float(a32 @ b32) / denom))


def coherence(embedding: torch.Tensor | None, focus: torch.Tensor | None) -> float | None:
    """``(cos(embedding, focus) + 1) / 2`` in [0, 1]; ``None`` (signal absent) when either is missing."""
    if embedding is None or focus is None:
        return None
    return (cosine(embedding, focus) + 1.0) / 2.0


def recovery_strength(recovered_turn: int | None, turn: int, decay: float = 0.7) -> float | None:
    """1.0 in the turn a chunk was recovered, times ``decay`` per turn after; ``None`` if never recovered."""
    if recovered_turn is None:
        return None
    return float(decay ** max(0, turn - recovered_turn))


def source_floor(kind: ChunkKind, raw: float, user_floor: float = 0.6, assistant_floor: float = 0.5) -> float:
    """Lift user and assistant chunks: USER ``uf + (1 - uf) * raw``, ASSISTANT ``af + (1 - af) * raw``,
    other kinds ``raw`` unchanged."""
    if kind is ChunkKind.USER:
        return user_floor + (1.0 - user_floor) * raw
    if kind is ChunkKind.ASSISTANT:
        return assistant_floor + (1.0 - assistant_floor) * raw
    return raw
