"""Chunks: the unit of a session's history that the memory policy scores, evicts and recovers.

A session's history is a list of :class:`Chunk`. A message is one chunk; a long one is cut into chunks of at
most ``SessionConfig.chunk_tokens`` tokens. (Not the pool's block: while resident, a chunk's tokens are a
segment of the engine's sequence, in pool blocks of their own.) A chunk keeps its token ids whatever its
state, so the session always knows its whole logical history. Plain metadata: no K/V lives here (the pool
and the store hold those), and not where they are either: a chunk's ``state`` and ``current_start`` are read
from its :class:`Placement`, its session's pager, which is the one record of residency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

import torch

from kvos.errors import ConfigError
from kvos.policy.digest import KeyDigest

Keep = Literal["pin", "prefer"]
KEEP_VALUES: tuple[str, ...] = ("pin", "prefer")


def _hint_problems(keep: object, priority: float) -> list[tuple[str, bool]]:
    """The checks of a chunk's hints: (what must hold, whether it fails)."""
    return [
        ("priority must be finite and >= 0", not (math.isfinite(priority) and priority >= 0)),
        ("keep must be 'pin', 'prefer' or None", keep is not None and keep not in KEEP_VALUES),
    ]


class ChunkKind(StrEnum):
    """Where a chunk's tokens came from."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    DOCUMENT = "document"


class ChunkState(StrEnum):
    """Where a chunk's K/V are: in the pool, saved in a store, or gone (breadcrumb or nothing)."""

    RESIDENT = "resident"
    SAVED = "saved"
    DISCARDED = "discarded"


class Placement(Protocol):
    """Who knows where a chunk's K/V are: a session's pager, for every chunk of its history."""

    def state_of(self, chunk_id: int) -> ChunkState:
        """Resident in the pool, saved in a store, or discarded."""
        ...

    def start_of(self, chunk_id: int) -> int | None:
        """The rotary position of its first token in the cache while resident, else None."""
        ...

    def cost_of(self, chunk_id: int) -> int | None:
        """The tokens a session's budget counts for it while resident (fewer than its tokens when its KV
        heads keep their own); None: its tokens."""
        ...


@dataclass(frozen=True)
class Detached:
    """The placement of a chunk no pager holds (yet): one being built, or one made by hand (tests)."""

    state: ChunkState = ChunkState.RESIDENT
    start: int | None = None

    def state_of(self, chunk_id: int) -> ChunkState:
        return self.state

    def start_of(self, chunk_id: int) -> int | None:
        return self.start

    def cost_of(self, chunk_id: int) -> int | None:
        return None


DETACHED = Detached()


@dataclass(eq=False)
class Chunk:
    """One chunk of a session's history.

    - ``original_start``: logical position of its first token in the session's whole history.
    - ``state`` and ``current_start`` (the rotary position of its first token in the cache while resident,
      ``None`` otherwise): read from ``placement``, the pager that holds it (:class:`Placement`).
    - ``priority``: score multiplier (>= 0); ``keep``: ``"pin"`` (never evicted) or ``"prefer"`` (score
      multiplied by the scorer's ``keep_boost``).
    - ``embedding``: float32 ``[dim]`` vector for coherence and similarity recovery, or ``None``.
    - ``recovered_turn``: the turn it was last recovered in (``None``: never).
    - ``text``: breadcrumb text; ``message_index``: which message of the history it belongs to.
    - ``digest``: the box of its keys, kept when its K/V leave the pool (:mod:`kvos.policy.digest`).
    - ``key_code``: its keys projected by a calibrated retriever, float16 ``[num_tokens, rank]``
      (:mod:`kvos.policy.retriever`): made once from its K/V, kept while they stay the same.
    - ``compressed_tokens``: how many of its first tokens the session's K/V compression has been applied to
      (:mod:`kvos.policy.compression`); its K/V carry the zeros wherever they go (pool, store, snapshot).

    Identity semantics (``eq=False``): two chunks are the same chunk only if they are the same object.
    """

    chunk_id: int
    kind: ChunkKind
    turn: int
    token_ids: list[int]
    original_start: int
    priority: float = 1.0
    keep: Keep | None = None
    embedding: torch.Tensor | None = None
    recovered_turn: int | None = None
    text: str = ""
    message_index: int = 0
    digest: KeyDigest | None = None
    key_code: torch.Tensor | None = None
    compressed_tokens: int = 0
    placement: Placement = field(default=DETACHED, init=False, repr=False)  # set by the pager that holds it

    def __post_init__(self) -> None:
        try:
            self.kind = ChunkKind(self.kind)
        except ValueError as e:
            raise ConfigError(f"Chunk {self.chunk_id}: {e}") from e
        problems = [
            ("original_start must be >= 0", self.original_start < 0),
            *_hint_problems(self.keep, self.priority),
            ("embedding must be 1-D [dim]", self.embedding is not None and self.embedding.dim() != 1),
        ]
        for message, bad in problems:
            if bad:
                raise ConfigError(f"Chunk {self.chunk_id}: {message}; {self!r:.300}")

    def set_hints(self, keep: Keep | None, priority: float) -> None:
        """Change the client's hints (checked as at construction): ConfigError for a bad value."""
        for message, bad in _hint_problems(keep, priority):
            if bad:
                raise ConfigError(f"Chunk {self.chunk_id}: {message}, got keep={keep!r}, priority={priority}")
        self.keep, self.priority = keep, priority

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the chunk."""
        return len(self.token_ids)

    @property
    def original_end(self) -> int:
        """Logical position one past its last token: ``original_start + num_tokens``."""
        return self.original_start + self.num_tokens

    @property
    def pinned(self) -> bool:
        """``keep == "pin"``: never evicted, scores 1.0."""
        return self.keep == "pin"

    @property
    def state(self) -> ChunkState:
        """Where its K/V are, as its placement records it."""
        return self.placement.state_of(self.chunk_id)

    @property
    def current_start(self) -> int | None:
        """The rotary position of its first token in the cache while resident, else None."""
        return self.placement.start_of(self.chunk_id)

    @property
    def cost(self) -> int:
        """The tokens the session's budget counts for it: its tokens, or fewer while it is resident with its
        KV heads keeping their own (:meth:`Pager.cost_of`): what paging it out frees of the budget."""
        cost = self.placement.cost_of(self.chunk_id)
        return self.num_tokens if cost is None else cost

    @property
    def resident(self) -> bool:
        """Its K/V are in the pool (state RESIDENT)."""
        return self.state is ChunkState.RESIDENT

    def is_sink(self, sink_count: int) -> bool:
        """An attention sink: it starts at a logical position below ``sink_count``; never evicted."""
        return self.original_start < sink_count
