"""Memory-policy scoring: chunks, signals, task focus and the scorer (exact numbers and orderings)."""

from __future__ import annotations

import math

import pytest
import torch

from kvos.errors import ConfigError, SignalError
from kvos.policy import (
    DEFAULT_WEIGHTS,
    SEED_WEIGHTS,
    AttentionTracker,
    Chunk,
    ChunkKind,
    ChunkState,
    ScoreContext,
    Scorer,
    ScoreWeights,
    TaskFocus,
    coherence,
    recency,
    recovery_strength,
    source_floor,
)
from kvos.policy.chunks import Detached

X = torch.tensor([1.0, 0.0])  # topic X
Y = torch.tensor([0.0, 1.0])  # topic Y, orthogonal to X
E = torch.tensor([1.0, 0.0])
F = torch.tensor([0.6, 0.8])  # cos(E, F) = 0.6 -> coherence 0.8
CHUNK_ID = iter(range(10**6))


def chunk(
    kind: ChunkKind = ChunkKind.DOCUMENT,
    start: int = 100,
    n: int = 50,
    embedding: torch.Tensor | None = None,
    **kw: object,
) -> Chunk:
    """A chunk of ``n`` tokens starting at logical position ``start`` (``state``: where a test puts it)."""
    state = kw.pop("state", ChunkState.RESIDENT)
    made = Chunk(next(CHUNK_ID), kind, 0, list(range(n)), start, embedding=embedding, **kw)  # type: ignore[arg-type]
    made.placement = Detached(state)  # type: ignore[arg-type]
    return made


# ---- chunks ----


def test_chunk_properties() -> None:
    c = chunk(ChunkKind.USER, start=10, n=7, keep="pin")
    assert (c.num_tokens, c.original_end, c.pinned, c.resident) == (7, 17, True, True)
    assert not c.is_sink(4) and c.is_sink(11)
    assert chunk(start=3).is_sink(4) and not chunk(start=4).is_sink(4)
    saved = chunk(state=ChunkState.SAVED, keep="prefer")
    assert not saved.resident and not saved.pinned
    assert Chunk(1, "tool", 0, [1], 0).kind is ChunkKind.TOOL  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw",
    [
        {"original_start": -1},
        {"priority": -0.5},
        {"priority": math.nan},
        {"keep": "always"},
        {"kind": "robot"},
        {"embedding": torch.zeros(2, 3)},
    ],
)
def test_chunk_rejects_bad_fields(kw: dict[str, object]) -> None:
    args: dict[str, object] = {
        "chunk_id": 1,
        "kind": ChunkKind.USER,
        "turn": 0,
        "token_ids": [1, 2],
        "original_start": 0,
    }
    with pytest.raises(ConfigError):
        Chunk(**{**args, **kw})  # type: ignore[arg-type]


# ---- signals ----


def test_recency_values() -> None:
    assert recency(0) == 1.0
    assert recency(-5) == 1.0
    assert recency(100) == pytest.approx(math.exp(-1.0), abs=1e-15)
    assert recency(50, rate=0.02) == pytest.approx(math.exp(-1.0), abs=1e-15)
    assert recency(250) == pytest.approx(0.0820849986, abs=1e-9)


def test_coherence_values_and_absence() -> None:
    assert coherence(E, F) == pytest.approx(0.8, abs=1e-7)
    assert coherence(E, E * 3.0) == pytest.approx(1.0, abs=1e-7)
    assert coherence(E, -E) == pytest.approx(0.0, abs=1e-7)
    assert coherence(X, Y) == pytest.approx(0.5, abs=1e-7)
    assert coherence(None, F) is None and coherence(E, None) is None
    with pytest.raises(SignalError):
        coherence(torch.ones(3), torch.ones(2))


def test_recovery_strength_by_turn() -> None:
    assert recovery_strength(None, 5) is None
    assert recovery_strength(3, 3) == 1.0
    assert recovery_strength(3, 4) == pytest.approx(0.7)
    assert recovery_strength(3, 5) == pytest.approx(0.49)
    assert recovery_strength(3, 6, decay=0.5) == pytest.approx(0.125)


def test_source_floors() -> None:
    assert source_floor(ChunkKind.USER, 0.0) == pytest.approx(0.6)
    assert source_floor(ChunkKind.USER, 0.5) == pytest.approx(0.8)
    assert source_floor(ChunkKind.ASSISTANT, 0.0) == pytest.approx(0.5)
    assert source_floor(ChunkKind.ASSISTANT, 0.4) == pytest.approx(0.7)
    for kind in (ChunkKind.DOCUMENT, ChunkKind.TOOL, ChunkKind.SYSTEM):
        assert source_floor(kind, 0.3) == 0.3
    assert source_floor(ChunkKind.USER, 0.5, user_floor=0.2) == pytest.approx(0.6)


# ---- task focus ----


def test_focus_first_update_sets_unit_vector() -> None:
    focus = TaskFocus()
    assert focus.similarity(E) is None
    assert focus.update(torch.tensor([3.0, 4.0])) is True
    assert focus.vector is not None
    torch.testing.assert_close(focus.vector, torch.tensor([0.6, 0.8]))


def test_focus_ema_exact_vector() -> None:
    focus = TaskFocus()
    focus.update(E)
    assert focus.update(F * 10.0) is False  # cos 0.6 >= 0.3: EMA, scale of the new embedding irrelevant
    mixed = torch.tensor([0.7 * 1.0 + 0.3 * 0.6, 0.3 * 0.8])  # [0.88, 0.24]
    assert focus.vector is not None
    torch.testing.assert_close(focus.vector, mixed / mixed.norm())


def test_focus_snaps_below_threshold_and_on_boundary() -> None:
    focus = TaskFocus()
    focus.update(E)
    near = torch.tensor([0.31, math.sqrt(1 - 0.31**2)])
    far = torch.tensor([0.29, math.sqrt(1 - 0.29**2)])
    assert focus.update(near) is False
    focus = TaskFocus(vector=E.clone())
    assert focus.update(far) is True
    assert focus.vector is not None
    torch.testing.assert_close(focus.vector, far)
    assert focus.update(far * 2.0 + 0.01 * E, boundary=True) is True  # similar, but a boundary
    torch.testing.assert_close(focus.vector, (far * 2.0 + 0.01 * E) / (far * 2.0 + 0.01 * E).norm())
    assert focus.update(-far) is True  # opposite topic


def test_focus_validation() -> None:
    with pytest.raises(ConfigError):
        TaskFocus(keep=1.5)
    with pytest.raises(ConfigError):
        TaskFocus(snap_below=2.0)
    with pytest.raises(SignalError):
        TaskFocus().update(torch.zeros(3))
    focus = TaskFocus(vector=E)
    with pytest.raises(SignalError):
        focus.update(torch.ones(3))


# ---- scorer ----


def test_raw_weighted_mean_absent_signals_leave_denominator() -> None:
    scorer = Scorer()  # default weights: recency 0.3, coherence 0.4, attention 0.3, recovery 0
    c = chunk(start=100, n=50, embedding=E)  # ends at 150; total 250 -> recency exp(-1)
    r = math.exp(-1.0)
    # recency only (no focus, no tracker): the mean of one signal is that signal
    assert scorer.raw(c, ScoreContext(turn=0, total_tokens=250)) == pytest.approx(r)
    # recency + coherence (0.8); attention tracker present but chunk never observed -> absent
    tracker = AttentionTracker()
    ctx = ScoreContext(turn=0, total_tokens=250, focus=F, attention=tracker)
    assert scorer.raw(c, ctx) == pytest.approx((0.3 * r + 0.4 * 0.8) / 0.7)
    # attention present: chunk mass 0.2, the top chunk 0.4 -> rescaled 0.5
    tracker.observe({c.chunk_id: 0.2, 999: 0.4})
    assert scorer.raw(c, ctx) == pytest.approx((0.3 * r + 0.4 * 0.8 + 0.3 * 0.5) / 1.0)
    # recovery has weight 0 by default: present but no effect
    c.recovered_turn = 0
    assert scorer.raw(c, ctx) == pytest.approx(0.3 * r + 0.4 * 0.8 + 0.3 * 0.5)


def test_raw_with_recovery_weight_and_no_weighted_signal() -> None:
    scorer = Scorer(weights=ScoreWeights(recency=0.5, coherence=0.0, attention=0.0, recovery=0.5))
    c = chunk(start=100, n=50, recovered_turn=2)
    r = math.exp(-1.0)
    assert scorer.raw(c, ScoreContext(turn=2, total_tokens=250)) == pytest.approx((r + 1.0) / 2)
    assert scorer.raw(c, ScoreContext(turn=4, total_tokens=250)) == pytest.approx((r + 0.49) / 2)
    only_attention = Scorer(weights=ScoreWeights(recency=0.0, coherence=0.0, attention=1.0, recovery=0.0))
    assert only_attention.raw(c, ScoreContext(turn=0, total_tokens=250)) == 0.0


def test_score_floors_priority_boost_and_cap() -> None:
    scorer = Scorer(weights=ScoreWeights(recency=1.0, coherence=0.0, attention=0.0, recovery=0.0))
    total = 150 + round(-math.log(0.3) / 0.01)  # recency of a chunk ending at 150 ~ 0.3
    ctx = ScoreContext(turn=0, total_tokens=total)
    r = math.exp(-0.01 * (total - 150))
    assert scorer.score(chunk(ChunkKind.DOCUMENT), ctx) == pytest.approx(r)
    assert scorer.score(chunk(ChunkKind.USER), ctx) == pytest.approx(0.6 + 0.4 * r)
    assert scorer.score(chunk(ChunkKind.ASSISTANT), ctx) == pytest.approx(0.5 + 0.5 * r)
    assert scorer.score(chunk(priority=2.0), ctx) == pytest.approx(2 * r)
    assert scorer.score(chunk(priority=0.5, keep="prefer"), ctx) == pytest.approx(r)
    assert scorer.score(chunk(keep="prefer"), ctx) == pytest.approx(2 * r)
    assert scorer.score(chunk(priority=2.0, keep="prefer"), ctx) == 1.0  # 4r > 1: capped
    assert scorer.score(chunk(ChunkKind.USER, priority=3.0), ctx) == 1.0
    assert scorer.score(chunk(ChunkKind.USER, priority=0.0), ctx) == 0.0


def test_sinks_and_pinned_score_one() -> None:
    scorer = Scorer()
    ctx = ScoreContext(turn=9, total_tokens=100_000)  # everything far away: recency ~ 0
    assert scorer.score(chunk(start=0, priority=0.0), ctx) == 1.0
    assert scorer.score(chunk(start=3), ctx) == 1.0
    assert scorer.score(chunk(start=4), ctx) < 0.01
    assert scorer.score(chunk(start=500, keep="pin", priority=0.0), ctx) == 1.0
    assert Scorer(sink_count=0).score(chunk(start=0), ctx) < 0.01


def test_scorer_ordering_follows_focus() -> None:
    scorer = Scorer()
    user_x = chunk(ChunkKind.USER, start=100, n=50, embedding=X)  # old (ends at 150), topic X
    doc_y = chunk(ChunkKind.DOCUMENT, start=1000, n=100, embedding=Y)  # recent (ends at 1100), topic Y
    on_x = ScoreContext(turn=3, total_tokens=1120, focus=X)
    s = scorer.scores([user_x, doc_y], on_x)
    assert s[user_x.chunk_id] == pytest.approx(0.6 + 0.4 * (0.3 * math.exp(-9.7) + 0.4) / 0.7)
    assert s[doc_y.chunk_id] == pytest.approx((0.3 * math.exp(-0.2) + 0.4 * 0.5) / 0.7)  # cos 0 -> 0.5
    assert s[user_x.chunk_id] > s[doc_y.chunk_id]
    on_y = ScoreContext(turn=4, total_tokens=1120, focus=Y * 5.0)
    s = scorer.scores([user_x, doc_y], on_y)
    assert s[user_x.chunk_id] == pytest.approx(0.6 + 0.4 * (0.3 * math.exp(-9.7) + 0.4 * 0.5) / 0.7)
    assert s[doc_y.chunk_id] == pytest.approx((0.3 * math.exp(-0.2) + 0.4 * 1.0) / 0.7)
    assert s[doc_y.chunk_id] > s[user_x.chunk_id]  # the focus moved to Y: the order reverses


def test_recent_on_topic_user_outranks_old_off_topic_document() -> None:
    for scorer in (Scorer.preset("default"), Scorer.preset("seed")):
        user = chunk(ChunkKind.USER, start=900, n=20, embedding=X)
        doc = chunk(ChunkKind.DOCUMENT, start=10, n=128, embedding=-X)
        s = scorer.scores([doc, user], ScoreContext(turn=1, total_tokens=930, focus=X))
        assert s[user.chunk_id] > 0.9 > 0.1 > s[doc.chunk_id]


def test_presets_and_validation() -> None:
    assert Scorer.preset("seed").weights == SEED_WEIGHTS == ScoreWeights(0.4, 0.6, 0.0, 0.0)
    assert Scorer.preset("default").weights == DEFAULT_WEIGHTS == ScoreWeights(0.3, 0.4, 0.3, 0.0)
    with pytest.raises(ConfigError):
        Scorer.preset("best")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ScoreWeights(recency=-0.1, coherence=0.0, attention=0.0, recovery=0.0)
    with pytest.raises(ConfigError):
        ScoreWeights(recency=math.inf, coherence=0.0, attention=0.0, recovery=0.0)
    for bad in ({"user_floor": 1.5}, {"keep_boost": 0.5}, {"recency_rate": -1.0}, {"sink_count": -1}):
        with pytest.raises(ConfigError):
            Scorer(**bad)
