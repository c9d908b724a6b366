"""The planner on hand-built residencies, without a model: exact plans, and properties over random sessions
(the budget is never exceeded when a plan says it fits; sinks, pins and held chunks never go; this turn's
protected chunks go only when nothing else can)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from seams import split_seams

from kvos.engine.engine import Engine
from kvos.engine.sampling import SamplingParams
from kvos.memory.growth import GrowthPolicy
from kvos.memory.pool import KVPool
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import Chunk, ChunkKind, ChunkState, Detached
from kvos.policy.planner import (
    Cut,
    Eviction,
    Residency,
    affordable,
    cheapest_elsewhere,
    plan_room,
    plan_truncate,
    pool_victim,
    pressure_victim,
)
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager

SINKS = 4


def chunks_of(sizes: list[int], keeps: list[str | None] | None = None) -> tuple[Chunk, ...]:
    """Resident chunks of these sizes laid end to end (the first one starts at 0: a sink)."""
    out, start = [], 0
    for i, size in enumerate(sizes):
        keep = keeps[i] if keeps else None
        out.append(Chunk(i, ChunkKind.USER, 1, list(range(size)), start, start, keep=keep, message_index=i))  # type: ignore[arg-type]
        start += size
    return tuple(out)


def residency(
    sizes: list[int],
    scores: list[float],
    budget: Budget,
    keeps: list[str | None] | None = None,
    protected: frozenset[int] = frozenset(),
) -> Residency:
    chunks = chunks_of(sizes, keeps)
    return Residency(chunks, dict(enumerate(scores)), sum(sizes), budget, SINKS, protected)


def test_nothing_goes_under_the_trigger() -> None:
    s = residency([10, 20, 30], [1.0, 0.2, 0.5], Budget(100, high=0.95, low=0.75))
    assert plan_room(s, 35) == plan_room(s, 0)
    plan = plan_room(s, 35)
    assert plan.evictions == () and plan.fits and plan.active_after == 60


def test_lowest_scores_go_down_to_the_low_watermark() -> None:
    # 10 + 20 + 30 + 25 = 85; 85 + 15 = 100 > 95: evict down to 75 (at most), lowest first
    s = residency([10, 20, 30, 25], [1.0, 0.6, 0.1, 0.3], Budget(100, high=0.95, low=0.75))
    plan = plan_room(s, 15)
    assert [e.chunk_id for e in plan.evictions] == [2]  # 100 - 30 = 70 <= 75
    assert plan.evictions[0] == Eviction(2, 30, 0.1, forced=False)
    assert plan.fits and plan.active_after == 55


def test_last_resort_takes_preferred_chunks_oldest_first_but_never_pins_or_held() -> None:
    budget = Budget(60, policy="hard")
    keeps: list[str | None] = [None, "prefer", "prefer", "pin", None]
    s = residency([5, 10, 10, 20, 10], [1.0, 1.4, 1.2, 1.0, 0.3], budget, keeps)
    plan = plan_room(s, 25, holding=frozenset({4}))  # 55 + 25 = 80: 20 must go, chunk 4 is held
    assert [(e.chunk_id, e.forced) for e in plan.evictions] == [(1, True), (2, True)]
    assert plan.fits and plan.active_after == 35
    assert not plan_room(s, 26, holding=frozenset({4})).fits  # sink 5 + pin 20 + held 10 + 26 > 60


def test_protected_chunks_yield_only_to_held_ones() -> None:
    budget = Budget(50, policy="hard")
    s = residency([4, 20, 20], [1.0, 0.1, 0.9], budget, protected=frozenset({1}))
    plan = plan_room(s, 20)  # 44 + 20 = 64: 14 must go; chunk 2 goes first though it scores higher
    assert [e.chunk_id for e in plan.evictions] == [2]
    plan = plan_room(s, 40)  # 84: both must go; the protected one last
    assert [e.chunk_id for e in plan.evictions] == [2, 1] and plan.fits


def test_a_question_and_the_start_of_its_reply_go_together() -> None:
    # 0 sink | 1 question, 2 its reply's first chunk, 3 the reply's second | 4 question, 5 its reply |
    # 6 pinned question, 7 its reply | 8 this turn's question
    sizes = [8, 6, 30, 20, 6, 12, 6, 20, 5]
    scores = [1.0, 0.75, 0.3, 0.1, 0.7, 0.2, 0.8, 0.6, 0.9]
    keeps: list[str | None] = [None] * 6 + ["pin", None, None]
    base = residency(sizes, scores, Budget(100, "hard"), keeps)
    pairs = {1: {1, 2}, 2: {1, 2}, 4: {4, 5}, 5: {4, 5}, 6: {6, 7}, 7: {6, 7}}
    units = {i: frozenset(u) for i, u in pairs.items()}
    s = Residency(base.resident, base.scores, base.active_tokens, base.budget, SINKS, frozenset(), units)
    plan = plan_room(s, 45)  # 113 + 45 = 158: 58 must go
    # by each unit's best score: 3 (0.1), 7 (0.6: its question is pinned, it goes alone), 4+5 (0.7)
    assert [e.chunk_id for e in plan.evictions] == [3, 7, 4, 5]
    assert [e.score for e in plan.evictions] == [0.1, 0.6, 0.7, 0.2]  # each chunk's own score is reported
    assert plan.fits and plan.active_after == 113 - 58
    held = plan_room(s, 45, holding=frozenset({5}))  # a held reply keeps its question
    assert [e.chunk_id for e in held.evictions] == [3, 7, 1, 2]
    # the reply being written (5, held) keeps its question until only this turn's protected chunks (1, 2,
    # 3) are left: then the question goes alone, before a recovered chunk yields
    guarded = Residency(base.resident, base.scores, 113, base.budget, SINKS, frozenset({1, 2, 3}), units)
    plan = plan_room(guarded, 25, holding=frozenset({5, 8}))
    assert [(e.chunk_id, e.forced) for e in plan.evictions] == [(7, False), (4, True), (3, True)]
    assert plan.fits and plan.active_after == 113 - 46
    alone = Residency(base.resident, base.scores, base.active_tokens, base.budget, SINKS)
    assert [e.chunk_id for e in plan_room(alone, 25).evictions] == [3, 5, 2]  # without units: by chunk


def test_pressure_victim_and_the_cheapest_of_other_sessions() -> None:
    budget = Budget(100)
    s = residency([4, 10, 10, 10], [1.0, 0.5, 0.2, 0.3], budget, protected=frozenset({2}))
    assert pressure_victim(s) == (Eviction(3, 10, 0.3),)
    assert pressure_victim(s, holding=frozenset({1, 3})) == (Eviction(2, 10, 0.2),)  # protection yields
    assert pressure_victim(s, holding=frozenset({1, 2, 3})) is None
    other = residency([4, 8], [1.0, 0.25], budget)
    assert cheapest_elsewhere({"a": s, "b": other}) == ("b", (Eviction(1, 8, 0.25),))
    assert cheapest_elsewhere({"a": residency([4], [1.0], budget)}) is None


def test_pool_pressure_takes_a_question_with_the_start_of_its_reply() -> None:
    # 0 sink | 1 question, 2 its reply's first chunk | 3 a chunk alone | 4 question, 5 its reply
    base = residency([8, 6, 30, 10, 6, 12], [1.0, 0.75, 0.1, 0.3, 0.5, 0.2], Budget(100))
    pairs = {1: {1, 2}, 2: {1, 2}, 4: {4, 5}, 5: {4, 5}}
    units = {i: frozenset(u) for i, u in pairs.items()}
    s = Residency(base.resident, base.scores, base.active_tokens, base.budget, SINKS, frozenset(), units)
    # by each unit's best score: 3 (0.3), then 4+5 (0.5), then 1+2 (0.75); each chunk's own score reported
    assert pressure_victim(s) == (Eviction(3, 10, 0.3),)
    without_3 = Residency(base.resident, base.scores, 72, base.budget, SINKS, frozenset({3}), units)
    assert pressure_victim(without_3) == (Eviction(4, 6, 0.5), Eviction(5, 12, 0.2))
    # the reply being written (5, held) keeps its question while anything else may go, then lets it go alone
    assert pressure_victim(without_3, holding=frozenset({5})) == (Eviction(1, 6, 0.75), Eviction(2, 30, 0.1))
    held = Residency(base.resident, base.scores, 72, base.budget, SINKS, frozenset({1, 2, 3}), units)
    assert pressure_victim(held, holding=frozenset({5})) == (Eviction(4, 6, 0.5),)
    # another session's cheapest unit is compared by its best chunk: 1+2 (0.75) against a lone 0.6
    lone = residency([4, 8], [1.0, 0.6], Budget(100))
    pair = Residency(base.resident, base.scores, 72, base.budget, SINKS, frozenset({3, 4, 5}), units)
    assert cheapest_elsewhere({"a": pair, "b": lone}) == ("b", (Eviction(1, 8, 0.6),))
    assert pool_victim(lone, {"a": pair}) == ("a", (Eviction(1, 6, 0.75), Eviction(2, 30, 0.1)))


def test_affordable_falls_back_to_the_message_then_the_chunk() -> None:
    chunks = {c.chunk_id: c for c in chunks_of([4, 30, 10, 20])}
    chunks[2].message_index = 1  # chunks 1 and 2 are one message; 3 its reply
    groups = [(2, [1, 2, 3]), (0, [0])]
    assert affordable(groups, chunks, room=60, top_k=2) == [(2, [1, 2, 3])]
    assert affordable(groups, chunks, room=45, top_k=2) == [(2, [1, 2]), (0, [0])]
    assert affordable(groups, chunks, room=15, top_k=2) == [(2, [2]), (0, [0])]
    assert affordable(groups, chunks, room=15, top_k=1) == [(2, [2])]


sessions = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(1, 40), min_size=n, max_size=n),
        st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9, 1.0, 1.5]), min_size=n, max_size=n),
        st.lists(st.sampled_from([None, None, None, "prefer", "pin"]), min_size=n, max_size=n),
        st.sets(st.integers(0, n - 1)),
        st.sets(st.integers(0, n - 1)),
    )
)


@settings(max_examples=300, deadline=None)
def history(sizes: list[int], states: str) -> tuple[Chunk, ...]:
    """Chunks laid end to end with these states: ``r`` resident, ``s`` saved, ``d`` discarded."""
    chunks = chunks_of(sizes)
    by_letter = {"r": ChunkState.RESIDENT, "s": ChunkState.SAVED, "d": ChunkState.DISCARDED}
    for chunk, letter in zip(chunks, states, strict=True):
        chunk.placement = Detached(by_letter[letter])
    return chunks


def test_a_cut_trims_the_resident_chunk_it_falls_in_and_discards_the_later_ones() -> None:
    chunks = history([10, 20, 30, 5], "rrrs")  # starts 0, 10, 30, 60; 65 tokens
    assert plan_truncate(chunks, 65) == Cut(65, None, ())
    assert plan_truncate(chunks, 100) == Cut(100, None, ())
    assert plan_truncate(chunks, 60) == Cut(60, None, (3,))
    assert plan_truncate(chunks, 45) == Cut(45, (2, 15), (3,))
    assert plan_truncate(chunks, 30) == Cut(30, None, (3, 2))  # at a chunk's start: it goes whole
    assert plan_truncate(chunks, 0) == Cut(0, None, (3, 2, 1, 0))


def test_a_cut_inside_a_chunk_that_is_not_resident_takes_it_whole() -> None:
    """Saved K/V (and a discarded chunk's breadcrumb) are one unit: the history is cut at its start."""
    chunks = history([10, 20, 30, 5], "rsdr")
    assert plan_truncate(chunks, 45) == Cut(30, None, (3, 2))
    assert plan_truncate(chunks, 11) == Cut(10, None, (3, 2, 1))
    assert plan_truncate(chunks, 5) == Cut(5, (0, 5), (3, 2, 1))


@given(
    st.lists(st.tuples(st.integers(1, 12), st.sampled_from("rsd")), min_size=1, max_size=8),
    st.integers(0, 100),
)
def test_plan_truncate_properties(rows: list[tuple[int, str]], length: int) -> None:
    """The chunks that stay end at or before the length kept, no later than asked; what goes is every
    chunk past it, latest first; a trim keeps part of a resident chunk and ends exactly at the length."""
    chunks = history([n for n, _ in rows], "".join(s for _, s in rows))
    cut = plan_truncate(chunks, length)
    assert cut.length <= length
    by_id = {c.chunk_id: c for c in chunks}
    assert list(cut.discard) == sorted(cut.discard, reverse=True)
    assert set(cut.discard) == {c.chunk_id for c in chunks if c.original_start >= cut.length}
    if cut.trim is None:
        assert all(c.original_end <= cut.length for c in chunks if c.chunk_id not in cut.discard)
        assert cut.length == length or cut.length == by_id[min(cut.discard)].original_start
    else:
        chunk_id, keep = cut.trim
        assert cut.length == length and by_id[chunk_id].resident
        assert 0 < keep < by_id[chunk_id].num_tokens and by_id[chunk_id].original_start + keep == length


@given(
    session=sessions,
    n=st.integers(0, 120),
    max_tokens=st.integers(1, 200),
    policy=st.sampled_from(["hard", "watermark"]),
)
def test_plan_room_properties(session: tuple, n: int, max_tokens: int, policy: str) -> None:
    sizes, scores, keeps, protected, holding = session
    budget = Budget(max_tokens, policy=policy)  # type: ignore[arg-type]
    s = residency(sizes, scores, budget, keeps, frozenset(protected))
    plan = plan_room(s, n, frozenset(holding))
    gone = [e.chunk_id for e in plan.evictions]
    assert len(gone) == len(set(gone))
    assert plan.active_after == s.active_tokens - sum(sizes[i] for i in gone)
    chunks = {c.chunk_id: c for c in s.resident}
    for i in gone:  # never a sink, a pin or a held chunk
        assert not chunks[i].is_sink(SINKS) and keeps[i] != "pin" and i not in holding
    if not budget.over(s.active_tokens + n):
        assert plan.evictions == () and plan.fits
        return
    assert plan.fits == (plan.active_after + n <= max_tokens)
    left = [c for c in s.resident if c.chunk_id not in gone]
    movable = [c for c in left if not c.is_sink(SINKS) and c.keep != "pin" and c.chunk_id not in holding]
    if not plan.fits:  # everything the rules let go went
        assert movable == []
    # a protected chunk goes only once every unprotected candidate has gone
    if any(i in protected for i in gone):
        assert all(c.chunk_id in protected for c in movable)
    # a chunk past the scorer's floor is forced: the stage before it could not make room
    assert all(e.forced for e in plan.evictions if scores[e.chunk_id] >= 1.0)


def test_sessions_under_pool_pressure_ask_before_they_allocate(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sessions over a capped pool (the server's layout: one manager, one engine): every allocation a
    session makes fits, because it asked the pool first and paged out to make room; pressure is relieved
    from the other session first, then from its own chunks."""
    model = load_model(model_dir)
    probe = Engine(model, block_size=8)
    engine = Engine(
        model,
        block_size=8,
        growth=GrowthPolicy(initial_tokens=64, max_bytes=probe.pool.layout.bytes_per_block * 40),
    )
    config = SessionConfig(budget=Budget(max_active_tokens=1000), chunk_tokens=24, embedder="tokens")
    m = MemoryManager(engine, load_tokenizer(model_dir), config)
    refused: list[int] = []
    alloc_n = KVPool.alloc_n

    def checked(pool: KVPool, n: int) -> list[int]:
        if not pool.can_allocate(n):
            refused.append(n)
        return alloc_n(pool, n)

    monkeypatch.setattr(KVPool, "alloc_n", checked)
    a, b = m.session("a"), m.session("b")
    filler = "the quick brown fox jumps over the lazy dog while it rains "
    for i in range(4):
        a.add_message("user", f"a{i} " + filler)
    for i in range(11):
        b.add_message("user", f"b{i} " + filler)
    assert refused == []
    assert any(e["event"] == "pressure" for e in a.memory.journal.events)
    assert any(e["event"] == "pool_full" for e in b.memory.journal.events)
    assert engine.pool.nbytes <= probe.pool.layout.bytes_per_block * 40
    m.close("a")
    m.close("b")
    assert engine.pool.allocator.num_used == 0


@pytest.mark.parametrize("backend", ["discard", "kv_restore"])
def test_pool_pressure_keeps_each_question_with_the_start_of_its_answer(
    model_dir: Path, backend: str
) -> None:
    """Two chatting sessions over a capped pool and a budget that never triggers: what leaves, leaves by
    the pool's pressure alone (from the other session, then, alone, from its own), and it leaves as the
    budget's plans take it, a question with its reply's start."""
    model = load_model(model_dir)
    probe = Engine(model, block_size=8)
    cap = probe.pool.layout.bytes_per_block * 48
    engine = Engine(model, block_size=8, growth=GrowthPolicy(initial_tokens=64, max_bytes=cap))
    config = SessionConfig(
        budget=Budget(max_active_tokens=100_000), chunk_tokens=24, embedder="tokens", backend=backend
    )
    m = MemoryManager(engine, load_tokenizer(model_dir), config)
    a, b = m.session("a"), m.session("b")
    turns = [(s, i) for i in range(8) for s in (a, b)] + [(b, i) for i in range(8, 14)]  # then b alone
    for s in (a, b):
        s.add_message("system", "be brief")
    for s, i in turns:
        if i == 8 and s is b and "a" in m.sessions:
            m.close("a")
        s.add_message("user", f"{s.session_id}{i} question: " + "the quick brown fox jumps " * (1 + i % 3))
        s.generate(SamplingParams(max_tokens=30, ignore_eos=True))
        assert split_seams(s) == [], (i, s.session_id)
        if "a" in m.sessions:
            assert split_seams(a) == [], (i, s.session_id)
    events = b.memory.journal.events
    gone = {e["chunk"] for e in events if e["event"] == "evict"}
    assert gone == {e["chunk"] for e in events if e["event"] in ("pressure", "pool_full")}  # the pool's
    assert {e["event"] for e in events} >= {"pressure", "pool_full"}
    assert any(b.chunks[c].kind is ChunkKind.USER for c in gone)  # questions went, with their answers
    assert engine.pool.nbytes <= cap
    m.close("b")
