"""The seam invariant of a session's cache, for the tests that page under a budget or a pool's cap."""

from __future__ import annotations

from kvos.session.session import Session
from kvos.session.units import seams


def split_seams(session: Session) -> list[int]:
    """The message indexes of the user messages whose seam is split: their last chunk resident and their
    reply's first chunk not, or the other way round. A chunk recovered this turn (protected: it came back
    without its partner, which did not fit) does not count."""
    protected = session.history.protected
    return [
        last.message_index
        for last, head in seams(session.chunks.values())
        if last.resident != head.resident and not {last.chunk_id, head.chunk_id} & protected
    ]
