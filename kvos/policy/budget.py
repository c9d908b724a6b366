"""The budget: when a session must evict, down to how many tokens, and which blocks go.

``Budget`` gives the trigger and target in resident tokens; :func:`select_victims` picks the lowest-scored
evictable blocks until the target is reached. Never evicted: sinks, pinned blocks, blocks scoring >= 1.0,
and protected blocks (the reply being generated, blocks recovered this turn).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvos.errors import ConfigError, SignalError
from kvos.policy.blocks import MemBlock

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
    blocks: Sequence[MemBlock],
    scores: Mapping[int, float],
    protected: Collection[int] = (),
    sink_count: int = 4,
) -> list[MemBlock]:
    """The RESIDENT blocks that may be evicted: not sinks, not pinned, scoring < 1.0, not protected.

    Raises :class:`SignalError` when a resident candidate has no score.
    """
    keep = set(protected)
    out = []
    for block in blocks:
        if not block.resident or block.is_sink(sink_count) or block.pinned or block.block_id in keep:
            continue
        if block.block_id not in scores:
            raise SignalError(f"block {block.block_id} has no score; score every resident block first")
        if scores[block.block_id] < 1.0:
            out.append(block)
    return out


def select_victims(
    blocks: Sequence[MemBlock],
    scores: Mapping[int, float],
    active_tokens: int,
    target: int,
    protected: Collection[int] = (),
    sink_count: int = 4,
) -> list[MemBlock]:
    """The blocks to evict, in eviction order, to bring ``active_tokens`` down to ``target``.

    Among :func:`evictable` blocks, the lowest-scored go first (ties: smaller ``original_start`` first),
    until ``active_tokens - sum(num_tokens) <= target``. Returns ``[]`` when already at or under the target,
    and every evictable block when even that does not reach it (the caller decides what to do then).
    """
    candidates = sorted(
        evictable(blocks, scores, protected, sink_count),
        key=lambda b: (scores[b.block_id], b.original_start, b.block_id),
    )
    victims: list[MemBlock] = []
    remaining = active_tokens
    for block in candidates:
        if remaining <= target:
            break
        victims.append(block)
        remaining -= block.num_tokens
    return victims
