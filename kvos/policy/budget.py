"""The budget: when a session must evict, down to how many tokens, and which chunks go.

``Budget`` gives the trigger and target in resident tokens; :func:`select_victims` picks the lowest-scored
evictable chunks until the target is reached. Never evicted: sinks, pinned chunks, chunks scoring >= 1.0,
and protected chunks (the reply being generated, chunks recovered this turn).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvos.errors import ConfigError, SignalError
from kvos.policy.chunks import Chunk

BudgetPolicy = Literal["watermark", "hard"]
BUDGET_POLICIES: tuple[str, ...] = ("watermark", "hard")


@dataclass(frozen=True)
class Budget:
    """A session's KV budget in resident tokens.

    ``watermark``: evict when resident tokens exceed ``floor(high * max_active_tokens)``, down to
    ``floor(low * max_active_tokens)``. ``hard``: trigger and target are ``max_active_tokens`` itself.
    """

    max_active_tokens: int = 8192
    policy: BudgetPolicy = "watermark"
    high: float = 0.95
    low: float = 0.75

    def __post_init__(self) -> None:
        if self.max_active_tokens <= 0:
            raise ConfigError(f"Budget.max_active_tokens must be positive, got {self.max_active_tokens}")
        if self.policy not in BUDGET_POLICIES:
            raise ConfigError(f"Budget.policy must be one of {BUDGET_POLICIES}, got {self.policy!r}")
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ConfigError(f"Budget needs 0 < low <= high <= 1, got low={self.low}, high={self.high}")

    def trigger(self) -> int:
        """Resident tokens above which the session evicts."""
        if self.policy == "hard":
            return self.max_active_tokens
        return math.floor(self.high * self.max_active_tokens)

    def target(self) -> int:
        """Resident tokens an eviction brings the session down to (at most)."""
        if self.policy == "hard":
            return self.max_active_tokens
        return math.floor(self.low * self.max_active_tokens)

    def over(self, active_tokens: int) -> bool:
        """``active_tokens > trigger()``: time to evict."""
        return active_tokens > self.trigger()


def evictable(
    chunks: Sequence[Chunk],
    scores: Mapping[int, float],
    protected: Collection[int] = (),
    sink_count: int = 4,
) -> list[Chunk]:
    """The RESIDENT chunks that may be evicted: not sinks, not pinned, scoring < 1.0, not protected.

    Raises :class:`SignalError` when a resident candidate has no score.
    """
    keep = set(protected)
    out = []
    for chunk in chunks:
        if not chunk.resident or chunk.is_sink(sink_count) or chunk.pinned or chunk.chunk_id in keep:
            continue
        if chunk.chunk_id not in scores:
            raise SignalError(f"chunk {chunk.chunk_id} has no score; score every resident chunk first")
        if scores[chunk.chunk_id] < 1.0:
            out.append(chunk)
    return out


def select_victims(
    chunks: Sequence[Chunk],
    scores: Mapping[int, float],
    active_tokens: int,
    target: int,
    protected: Collection[int] = (),
    sink_count: int = 4,
    units: Mapping[int, Collection[int]] | None = None,
) -> list[Chunk]:
    """The chunks to evict, in eviction order, to bring ``active_tokens`` down to ``target``.

    Among :func:`evictable` chunks, the lowest-scored go first (ties: smaller ``original_start`` first),
    until ``active_tokens - sum(cost) <= target`` (:attr:`Chunk.cost`). ``units``: chunk id -> the ids of
    the chunks that go with it (itself included); a unit goes whole, scored as its best chunk, and only
    when every chunk of it that is resident, unpinned and no sink is evictable (a pinned question's reply
    goes alone).
    Returns ``[]`` when already at or under the target, and every evictable unit when even that does not
    reach it (the caller decides what to do then).
    """
    candidates = evictable(chunks, scores, protected, sink_count)
    by_id = {c.chunk_id: c for c in candidates}
    open_ = {c.chunk_id for c in chunks if c.resident and not c.pinned and not c.is_sink(sink_count)}
    groups: list[list[Chunk]] = []
    seen: set[int] = set()
    for chunk in sorted(candidates, key=lambda c: c.original_start):
        if chunk.chunk_id in seen:
            continue
        members = [i for i in (units or {}).get(chunk.chunk_id, (chunk.chunk_id,)) if i in open_]
        seen.update(members)
        if all(i in by_id for i in members):
            groups.append(sorted((by_id[i] for i in members), key=lambda c: c.original_start))
    groups.sort(key=lambda g: (max(scores[c.chunk_id] for c in g), g[0].original_start, g[0].chunk_id))
    victims: list[Chunk] = []
    remaining = active_tokens
    for group in groups:
        if remaining <= target:
            break
        victims.extend(group)
        remaining -= sum(c.cost for c in group)
    return victims
