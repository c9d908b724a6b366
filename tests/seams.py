"""The seam invariant of a session's cache, for the tests that page under a budget or a pool's cap."""

from __future__ import annotations

from kvos.policy.chunks import Chunk, ChunkKind
from kvos.session.session import Session


def split_seams(session: Session) -> list[int]:
    """The user messages whose seam is split: their last chunk resident and their reply's first chunk not,
    or the other way round. A chunk recovered this turn (protected: it came back without its partner,
    which did not fit) does not count."""
    by_message: dict[int, list[Chunk]] = {}
    for c in sorted(session.chunks.values(), key=lambda c: c.original_start):
        by_message.setdefault(c.message_index, []).append(c)
    split = []
    for index, chunks in by_message.items():
        if chunks[0].kind is ChunkKind.USER and index + 1 in by_message:
            seam = (chunks[-1], by_message[index + 1][0])
            if any(c.chunk_id in session.history.protected for c in seam):
                continue
            if seam[0].resident != seam[1].resident:
                split.append(index)
    return split
