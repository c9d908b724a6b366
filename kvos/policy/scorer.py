"""The scorer: one number in [0, 1] per chunk, from present signals, source floors, priority and keep.

``raw`` is the weighted mean of the signals that are present (recency, coherence, attention, recovery); an
absent signal leaves both numerator and denominator. ``score`` then applies sinks and pins (1.0), the
source floor of the chunk's kind, its priority, the ``prefer`` boost, and caps at 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal

import torch

from kvos.errors import ConfigError
from kvos.policy.attention import AttentionTracker
from kvos.policy.chunks import Chunk
from kvos.policy.signals import coherence, recency, recovery_strength, source_floor


@dataclass(frozen=True)
class ScoreWeights:
    """Weights of the four signals in the weighted mean (each finite and >= 0)."""

    recency: float
    coherence: float
    attention: float
    recovery: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ConfigError(f"ScoreWeights.{f.name} must be finite and >= 0, got {value}")


# The reference system's values (attention off there), kept as the "seed" preset.
SEED_WEIGHTS = ScoreWeights(recency=0.4, coherence=0.6, attention=0.0, recovery=0.0)
# Tuned on the recall benchmark (docs/benchmarks.md, "scorer weights"): no mix tried measured better (all
# within 62-72% at 25% and 50% budgets, 40 sessions); this one ties for best and keeps the attention signal.
DEFAULT_WEIGHTS = ScoreWeights(recency=0.3, coherence=0.4, attention=0.3, recovery=0.0)


@dataclass
class ScoreContext:
    """What the scorer needs to know about the session now.

    ``total_tokens``: logical tokens in the session so far; a chunk's recency distance is
    ``total_tokens - chunk.original_end``. ``focus``: the task focus ``[dim]`` (``None``: coherence absent).
    ``attention``: the tracker (``None``: attention absent).
    """

    turn: int
    total_tokens: int
    focus: torch.Tensor | None = None
    attention: AttentionTracker | None = None


@dataclass
class Scorer:
    """Scores chunks; see the module docstring. ``keep_boost`` multiplies chunks marked ``keep="prefer"``;
    chunks starting below ``sink_count`` are sinks and score 1.0."""

    weights: ScoreWeights = DEFAULT_WEIGHTS
    recency_rate: float = 0.01
    user_floor: float = 0.6
    assistant_floor: float = 0.5
    keep_boost: float = 2.0
    recovery_decay: float = 0.7
    sink_count: int = 4

    def __post_init__(self) -> None:
        checks = [
            ("recency_rate", ">= 0", self.recency_rate >= 0.0),
            ("user_floor", "in [0, 1]", 0.0 <= self.user_floor <= 1.0),
            ("assistant_floor", "in [0, 1]", 0.0 <= self.assistant_floor <= 1.0),
            ("keep_boost", ">= 1", self.keep_boost >= 1.0),
            ("recovery_decay", "in [0, 1]", 0.0 <= self.recovery_decay <= 1.0),
            ("sink_count", ">= 0", self.sink_count >= 0),
        ]
        for name, limit, ok in checks:
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise ConfigError(f"Scorer.{name} must be {limit}, got {value}")

    def signals(self, chunk: Chunk, ctx: ScoreContext) -> dict[str, float | None]:
        """Each signal's value for ``chunk`` (``None`` where absent), keyed by the weight's name."""
        return {
            "recency": recency(ctx.total_tokens - chunk.original_end, self.recency_rate),
            "coherence": coherence(chunk.embedding, ctx.focus),
            "attention": None if ctx.attention is None else ctx.attention.value(chunk.chunk_id),
            "recovery": recovery_strength(chunk.recovered_turn, ctx.turn, self.recovery_decay),
        }

    def raw(self, chunk: Chunk, ctx: ScoreContext) -> float:
        """Weighted mean of the present signals; 0.0 when no signal with a positive weight is present."""
        num = den = 0.0
        for name, value in self.signals(chunk, ctx).items():
            weight = getattr(self.weights, name)
            if value is not None and weight > 0.0:
                num += weight * value
                den += weight
        return num / den if den > 0.0 else 0.0

    def score(self, chunk: Chunk, ctx: ScoreContext) -> float:
        """1.0 for sinks and pinned chunks; else ``min(floor(kind, raw) * priority * boost, 1.0)`` where
        ``boost`` is ``keep_boost`` for ``keep="prefer"``, else 1."""
        if chunk.is_sink(self.sink_count) or chunk.pinned:
            return 1.0
        floored = source_floor(chunk.kind, self.raw(chunk, ctx), self.user_floor, self.assistant_floor)
        boost = self.keep_boost if chunk.keep == "prefer" else 1.0
        return min(floored * chunk.priority * boost, 1.0)

    def scores(self, chunks: Iterable[Chunk], ctx: ScoreContext) -> dict[int, float]:
        """``chunk_id -> score`` for every chunk given."""
        return {chunk.chunk_id: self.score(chunk, ctx) for chunk in chunks}

    @classmethod
    def preset(cls, name: Literal["default", "seed"]) -> Scorer:
        """``"default"``: :data:`DEFAULT_WEIGHTS`; ``"seed"``: :data:`SEED_WEIGHTS` (reference system)."""
        presets = {"default": DEFAULT_WEIGHTS, "seed": SEED_WEIGHTS}
        if name not in presets:
            raise ConfigError(f"unknown scorer preset {name!r}; choose one of {sorted(presets)}")
        return cls(weights=presets[name])
