"""Budget trigger/target and victim selection: exact victims, never the protected, property-checked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos.errors import ConfigError, SignalError
from kvos.policy import BlockKind, BlockState, Budget, MemBlock, ScoreContext, Scorer, select_victims


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


def mk(block_id: int, start: int, n: int, **kw: object) -> MemBlock:
    return MemBlock(block_id, BlockKind.DOCUMENT, 0, [0] * n, start, **kw)  # type: ignore[arg-type]


def test_select_victims_exact_order() -> None:
    blocks = [
        mk(0, 0, 10),  # sink
        mk(1, 10, 10),
        mk(2, 20, 10, keep="pin"),
        mk(3, 30, 10),  # scores 1.0
        mk(4, 40, 10),  # protected
        mk(5, 50, 10),
        mk(6, 60, 10, state=BlockState.SAVED),
        mk(7, 70, 10),
        mk(8, 80, 10),
    ]
    scores = {0: 0.0, 1: 0.5, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.2, 6: 0.0, 7: 0.5, 8: 0.9}
    active = 80  # resident tokens

    def ids(target: int) -> list[int]:
        victims = select_victims(blocks, scores, active, target, protected={4})
        return [b.block_id for b in victims]

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
    blocks = [mk(0, 0, 2), mk(1, 2, 2), mk(2, 4, 2)]
    scores = {0: 0.1, 1: 0.1, 2: 0.1}
    assert [b.block_id for b in select_victims(blocks, scores, 6, 0, sink_count=4)] == [2]
    assert [b.block_id for b in select_victims(blocks, scores, 6, 0, sink_count=0)] == [0, 1, 2]
    with pytest.raises(SignalError):
        select_victims(blocks, {0: 0.1}, 6, 0)


def test_off_topic_block_evicted_first_with_scorer() -> None:
    x = torch.tensor([1.0, 0.0])
    user = MemBlock(1, BlockKind.USER, 1, [0] * 20, 900, embedding=x)
    doc_on = MemBlock(2, BlockKind.DOCUMENT, 0, [0] * 128, 100, embedding=x)
    doc_off = MemBlock(3, BlockKind.DOCUMENT, 0, [0] * 128, 228, embedding=-x)
    blocks = [doc_on, doc_off, user]
    scores = Scorer().scores(blocks, ScoreContext(turn=1, total_tokens=920, focus=x))
    victims = select_victims(blocks, scores, 276, 200)
    assert victims == [doc_off]


Case = tuple[list[MemBlock], dict[int, float], set[int], int, int, int]


@st.composite
def block_sets(draw: st.DrawFn) -> Case:
    """Random blocks (states, keeps, tied scores, some >= 1), protected ids, active tokens, target, sinks."""
    n = draw(st.integers(0, 12))
    blocks, scores, start = [], {}, draw(st.integers(0, 6))
    for i in range(n):
        size = draw(st.integers(1, 40))
        state = draw(st.sampled_from(list(BlockState)))
        keep = draw(st.sampled_from([None, None, "pin", "prefer"]))
        blocks.append(mk(i, start, size, state=state, keep=keep))
        scores[i] = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.99, 1.0, 1.5]))
        start += size
    protected = set(draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=4)))
    active = sum(b.num_tokens for b in blocks if b.resident)
    target = draw(st.integers(0, active + 5))
    sink_count = draw(st.sampled_from([0, 4, 8]))
    return draw(st.permutations(blocks)), scores, protected, active, target, sink_count


@settings(max_examples=300, deadline=None)
@given(block_sets())
def test_select_victims_property(case: Case) -> None:
    """The victims are exactly the shortest lowest-scored evictable prefix reaching the target (or all)."""
    blocks, scores, protected, active, target, sink_count = case
    victims = select_victims(blocks, scores, active, target, protected, sink_count)
    for v in victims:  # never a sink, pin, score >= 1, protected or non-resident block
        assert v.resident and not v.pinned and not v.is_sink(sink_count)
        assert scores[v.block_id] < 1.0 and v.block_id not in protected
    allowed = sorted(
        (
            b
            for b in blocks
            if b.resident
            and not b.pinned
            and b.original_start >= sink_count
            and scores[b.block_id] < 1.0
            and b.block_id not in protected
        ),
        key=lambda b: (scores[b.block_id], b.original_start),
    )
    k = 0
    while k < len(allowed) and active - sum(b.num_tokens for b in allowed[:k]) > target:
        k += 1
    assert victims == allowed[:k]
