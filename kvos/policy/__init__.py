"""The memory policy: chunk metadata, the scorer and its signals, task focus, attention tracking, budget and
victim selection, recovery signals, compression (sparsification, entropy budgets, per-head token policies).
Imports the layers below it (memory, model, engine) and never the session or server layers."""

from kvos.policy.attention import AttentionTracker, chunk_masses
from kvos.policy.budget import Budget, evictable, select_victims
from kvos.policy.chunks import Chunk, ChunkKind, ChunkState, Keep
from kvos.policy.focus import TaskFocus
from kvos.policy.scorer import DEFAULT_WEIGHTS, SEED_WEIGHTS, ScoreContext, Scorer, ScoreWeights
from kvos.policy.signals import coherence, cosine, recency, recovery_strength, source_floor

__all__ = [
    "DEFAULT_WEIGHTS",
    "SEED_WEIGHTS",
    "AttentionTracker",
    "Budget",
    "Chunk",
    "ChunkKind",
    "ChunkState",
    "Keep",
    "ScoreContext",
    "ScoreWeights",
    "Scorer",
    "TaskFocus",
    "chunk_masses",
    "coherence",
    "cosine",
    "evictable",
    "recency",
    "recovery_strength",
    "select_victims",
    "source_floor",
]
