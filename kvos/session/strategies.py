"""Named memory strategies: kvos's own (by recovery backend) and the standard baselines, as session configs.

The baselines evict at chunk granularity through the same machinery as kvos, with only their own signal:
StreamingLLM keeps the sinks and the most recent chunks; H2O ranks by cumulative attention (heavy hitters)
with recency; SnapKV ranks by the attention of each prompt's last 32 queries. None of them recovers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvos.errors import ConfigError
from kvos.policy.budget import Budget
from kvos.policy.scorer import Scorer, ScoreWeights
from kvos.session.config import SessionConfig


def _baseline(weights: ScoreWeights, **cfg: Any) -> Callable[[Budget, int], SessionConfig]:
    def make(budget: Budget, chunk_tokens: int) -> SessionConfig:
        scorer = Scorer(weights=weights, user_floor=0.0, assistant_floor=0.0)
        return SessionConfig(
            budget=budget, chunk_tokens=chunk_tokens, scorer=scorer, backend="discard", **cfg
        )

    return make


def _kvos(backend: str) -> Callable[[Budget, int], SessionConfig]:
    def make(budget: Budget, chunk_tokens: int) -> SessionConfig:
        return SessionConfig(budget=budget, chunk_tokens=chunk_tokens, backend=backend)  # type: ignore[arg-type]

    return make


STRATEGIES: dict[str, Callable[[Budget, int], SessionConfig]] = {
    "full": _kvos("kv_restore"),  # run with a budget that never triggers: the no-eviction reference
    "streaming_llm": _baseline(ScoreWeights(recency=1.0, coherence=0.0, attention=0.0, recovery=0.0)),
    "h2o": _baseline(
        ScoreWeights(recency=0.5, coherence=0.0, attention=0.5, recovery=0.0), attention_mode="cumulative"
    ),
    "snapkv": _baseline(
        ScoreWeights(recency=0.0, coherence=0.0, attention=1.0, recovery=0.0), attention_mode="snapshot"
    ),
    "kvos-discard": _kvos("discard"),
    "kvos-breadcrumb": _kvos("breadcrumb"),
    "kvos-kv_restore": _kvos("kv_restore"),
}


def strategy(name: str, budget: Budget, chunk_tokens: int) -> SessionConfig:
    """The session config of a named strategy."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return STRATEGIES[name](budget, chunk_tokens)
