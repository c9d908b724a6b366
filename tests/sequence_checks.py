"""Every test checks what :class:`kvos.engine.sequence.Sequence` keeps between decoded tokens (its segments'
boundaries, block count and per-head segments, kept while only the last segment grows) against a fresh pass
over the segments each time one is asked: whatever path of the suite changes a sequence (evictions, splices,
per-head segments, branches, truncation), a kept answer that went stale fails it. Installed by
``conftest.py``."""

from __future__ import annotations

from itertools import accumulate

from kvos.engine.sequence import Segment, Sequence

_boundaries = Sequence.boundaries
_num_blocks = vars(Sequence)["num_blocks"].fget
_head_segments = Sequence.head_segments
assert _num_blocks is not None


def fresh_boundaries(seq: Sequence) -> list[int]:
    return list(accumulate((seg.num_tokens for seg in seq.segments), initial=0))


def fresh_num_blocks(seq: Sequence) -> int:
    return sum(seg.page_table.num_blocks for seg in seq.segments)


def _checked_boundaries(seq: Sequence) -> list[int]:
    kept = _boundaries(seq)
    assert kept == fresh_boundaries(seq), f"kept boundaries {kept} != {fresh_boundaries(seq)}"
    return kept


def _checked_num_blocks(seq: Sequence) -> int:
    assert _num_blocks is not None
    kept = _num_blocks(seq)
    assert kept == fresh_num_blocks(seq), f"kept block count {kept} != {fresh_num_blocks(seq)}"
    return kept


def _checked_head_segments(seq: Sequence) -> list[Segment]:
    kept = _head_segments(seq)
    assert kept == [seg for seg in seq.segments if seg.heads is not None], "kept per-head segments went stale"
    return kept


def install() -> None:
    Sequence.head_segments = _checked_head_segments  # type: ignore[method-assign,assignment]
    Sequence.boundaries = _checked_boundaries  # type: ignore[method-assign,assignment]
    Sequence.num_blocks = property(_checked_num_blocks)  # type: ignore[method-assign,assignment]
