"""A session's history: every chunk (resident or not), its turn, its length and this turn's protections.

One :class:`History` per session is the owner of that state; the session, its memory policy and its pager
read and change it through this object (where a chunk's K/V are is the pager's business, what the
chunks are and in which order is the history's).
"""

from __future__ import annotations

from kvos.policy.chunks import Chunk, ChunkKind


class History:
    """The chunks of one session by id, in history order on demand, with its turn and token count.

    - ``turn``: how many user turns began (the turn chunks are tagged with);
    - ``tokens``: the logical history's length (resident, saved and discarded chunks alike);
    - ``protected``: chunk ids kept for this turn (recovered ones), cleared when a turn begins.
    """

    def __init__(self) -> None:
        self.chunks: dict[int, Chunk] = {}
        self.turn = 0
        self.tokens = 0
        self.protected: set[int] = set()
        self.next_id = 0

    def new_chunk_id(self) -> int:
        """A chunk id never used in this history (ids only grow, also across truncations)."""
        self.next_id += 1
        return self.next_id - 1

    def add(self, chunk: Chunk) -> None:
        """Register a new chunk (its tokens may still grow: a reply being written)."""
        self.chunks[chunk.chunk_id] = chunk

    def begin_turn(self) -> None:
        """A new user message: the next turn, last turn's protections lifted."""
        self.turn += 1
        self.protected.clear()

    def in_order(self) -> list[Chunk]:
        """Every chunk in history order."""
        return sorted(self.chunks.values(), key=lambda c: c.original_start)

    def token_ids(self) -> list[int]:
        """Every token of the logical history (resident, saved or discarded chunks alike), in order."""
        return [t for c in self.in_order() for t in c.token_ids]

    def last_turn_start(self) -> int:
        """Where the last user message begins in the history (0 when there is none)."""
        users = [c for c in self.chunks.values() if c.kind is ChunkKind.USER]
        if not users:
            return 0
        last = max(users, key=lambda c: c.original_start)
        return min(c.original_start for c in users if c.message_index == last.message_index)

    def last(self) -> Chunk | None:
        """The chunk that ends the history (None when it is empty)."""
        return max(self.chunks.values(), key=lambda c: c.original_start, default=None)

    def locked_tokens(self, sink_count: int, with_protected: bool = False) -> int:
        """Resident tokens no budget eviction may take: pinned chunks and sinks (and, ``with_protected``,
        the chunks protected this turn)."""
        return sum(
            c.num_tokens
            for c in self.chunks.values()
            if c.resident
            and (c.pinned or c.is_sink(sink_count) or (with_protected and c.chunk_id in self.protected))
        )
