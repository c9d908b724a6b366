"""Budget trigger/target and victim selection: exact victims, never the protected, property-checked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos.errors import ConfigError, SignalError
from kvos.policy import Budget, Chunk, ChunkKind, ChunkState, ScoreContext, Scorer, select_victims
from kvos.policy.chunks import Detached


def test_budget_watermark_and_hard() -> None:
    b = Budget()
    assert (b.max_active_tokens, b.policy, b.trigger(), b.target()) == (8192, "watermark", 7782, 6144)
    assert not b.over(7782) and b.over(7783)
    hard = Budget(8192, policy="hard")
    assert (hard.trigger(), hard.target()) == (8192, 8192)
    assert not hard.over(8192) and hard.over(8193)
    server = Budget(1000, high=0.92, low=0.70)
    assert (server.trigger(), server.target()) == (920, 700)
    assert Budget(10, high=1.0, low=1.0).target() == 10


@pytest.mark.parametrize(
    "kw",
    [
        {"max_active_tokens": 0},
        {"policy": "soft"},
        {"low": 0.0},
        {"low": 0.9, "high": 0.8},
        {"high": 1.01},
    ],
)
def test_budget_validation(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Budget(**kw)  # type: ignore[arg-type]


def mk(chunk_id: int, start: int, n: int, state: ChunkState = ChunkState.RESIDENT, **kw: object) -> Chunk:
    chunk = Chunk(chunk_id, ChunkKind.DOCUMENT, 0, [0] * n, start, **kw)  # type: ignore[arg-type]
    chunk.placement = Detached(state)  # no pager here: the chunk's state as a test sets it
    return chunk


def test_select_victims_exact_order() -> None:
    chunks = [
        mk(0, 0, 10),  # sink
        mk(1, 10, 10),
        mk(2, 20, 10, keep="pin"),
        mk(3, 30, 10),  # scores 1.0
        mk(4, 40, 10),  # protected
        mk(5, 50, 10),
        mk(6, 60, 10, state=ChunkState.SAVED),
        mk(7, 70, 10),
        mk(8, 80, 10),
    ]
    scores = {0: 0.0, 1: 0.5, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.2, 6: 0.0, 7: 0.5, 8: 0.9}
    active = 80  # resident tokens

    def ids(target: int) -> list[int]:
        victims = select_victims(chunks, scores, active, target, protected={4})
        return [c.chunk_id for c in victims]

    assert ids(80) == [] and ids(100) == []
    assert ids(79) == [5]
    assert ids(70) == [5]
    assert ids(65) == [5, 1]  # 1 and 7 tie at 0.5: the older (start 10) first
    assert ids(60) == [5, 1]
    assert ids(55) == [5, 1, 7]
    assert ids(50) == [5, 1, 7]
    assert ids(45) == [5, 1, 7, 8]
    assert ids(40) == [5, 1, 7, 8]  # exactly reaches the target
    assert ids(0) == [5, 1, 7, 8]  # not enough evictable: all of them, nothing protected


def test_select_victims_sink_count_and_missing_score() -> None:
    chunks = [mk(0, 0, 2), mk(1, 2, 2), mk(2, 4, 2)]
    scores = {0: 0.1, 1: 0.1, 2: 0.1}
    assert [c.chunk_id for c in select_victims(chunks, scores, 6, 0, sink_count=4)] == [2]
    assert [c.chunk_id for c in select_victims(chunks, scores, 6, 0, sink_count=0)] == [0, 1, 2]
    with pytest.raises(SignalError):
        select_victims(chunks, {0: 0.1}, 6, 0)


def test_off_topic_chunk_evicted_first_with_scorer() -> None:
    x = torch.tensor([1.0, 0.0])
    user = Chunk(1, ChunkKind.USER, 1, [0] * 20, 900, embedding=x)
    doc_on = Chunk(2, ChunkKind.DOCUMENT, 0, [0] * 128, 100, embedding=x)
    doc_off = Chunk(3, ChunkKind.DOCUMENT, 0, [0] * 128, 228, embedding=-x)
    chunks = [doc_on, doc_off, user]
    scores = Scorer().scores(chunks, ScoreContext(turn=1, total_tokens=920, focus=x))
    victims = select_victims(chunks, scores, 276, 200)
    assert victims == [doc_off]


Case = tuple[list[Chunk], dict[int, float], set[int], int, int, int]


@st.composite
def chunk_sets(draw: st.DrawFn) -> Case:
    """Random chunks (states, keeps, tied scores, some >= 1), protected ids, active tokens, target, sinks."""
    n = draw(st.integers(0, 12))
    chunks, scores, start = [], {}, draw(st.integers(0, 6))
    for i in range(n):
        size = draw(st.integers(1, 40))
        state = draw(st.sampled_from(list(ChunkState)))
        keep = draw(st.sampled_from([None, None, "pin", "prefer"]))
        chunks.append(mk(i, start, size, state=state, keep=keep))
        scores[i] = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.99, 1.0, 1.5]))
        start += size
    protected = set(draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=4)))
    active = sum(c.num_tokens for c in chunks if c.resident)
    target = draw(st.integers(0, active + 5))
    sink_count = draw(st.sampled_from([0, 4, 8]))
    return draw(st.permutations(chunks)), scores, protected, active, target, sink_count


@settings(max_examples=300, deadline=None)
@given(chunk_sets())
def test_select_victims_property(case: Case) -> None:
    """The victims are exactly the shortest lowest-scored evictable prefix reaching the target (or all)."""
    chunks, scores, protected, active, target, sink_count = case
    victims = select_victims(chunks, scores, active, target, protected, sink_count)
    for v in victims:  # never a sink, pin, score >= 1, protected or non-resident chunk
        assert v.resident and not v.pinned and not v.is_sink(sink_count)
        assert scores[v.chunk_id] < 1.0 and v.chunk_id not in protected
    allowed = sorted(
        (
            c
            for c in chunks
            if c.resident
            and not c.pinned
            and c.original_start >= sink_count
            and scores[c.chunk_id] < 1.0
            and c.chunk_id not in protected
        ),
        key=lambda c: (scores[c.chunk_id], c.original_start),
    )
    k = 0
    while k < len(allowed) and active - sum(c.num_tokens for c in allowed[:k]) > target:
        k += 1
    assert victims == allowed[:k]
