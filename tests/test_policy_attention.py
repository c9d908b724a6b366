"""The attention signal: per-chunk masses from attention probabilities, and the tracker's three modes."""

from __future__ import annotations

import itertools
import json
import random
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos.errors import ConfigError, SignalError
from kvos.policy import AttentionTracker, chunk_masses

# ---- chunk_masses ----


def test_chunk_masses_hand_computed() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    # head 0: [0.1, 0.5, 0.4]; head 1: [0.4, 0.5, 0.1]; mean over heads
    torch.testing.assert_close(chunk_masses(probs, [0, 1, 3, 4]), torch.tensor([0.25, 0.5, 0.25]))
    # an empty chunk gets 0; one chunk gets everything
    torch.testing.assert_close(chunk_masses(probs, [0, 2, 2, 4]), torch.tensor([0.5, 0.0, 0.5]))
    torch.testing.assert_close(chunk_masses(probs, torch.tensor([0, 4])), torch.tensor([1.0]))
    torch.testing.assert_close(chunk_masses(probs, list(np.array([0, 1, 4]))), torch.tensor([0.25, 0.75]))


@pytest.mark.parametrize("kernel", ["native", "avx2", "portable", "numpy"])
def test_a_decode_steps_masses_from_its_captured_layers(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a session observes each decoded token: the captured layers' rows (views of the decode kernel's
    [B, H, T_max] probabilities, rows apart) stacked, as chunk_masses of their concatenation gives them,
    from the decode kernel's chunk_masses and from the numpy path alike; bad boundaries are SignalErrors
    either way (the kernel's refusal falls back to the checks that name the fault)."""
    from kvos.model import decode_kernel
    from kvos.policy.attention import chunk_mass_list

    built = None if kernel == "numpy" else decode_kernel.BUILDS[kernel]()
    if kernel != "numpy" and built is None:
        pytest.skip(f"the decode kernel's {kernel} build is not made here (no compiler, or disabled)")
    monkeypatch.setattr(decode_kernel, "kernel", lambda: built)
    g = torch.Generator().manual_seed(3)
    step = torch.softmax(torch.randn(3, 9, 40, generator=g), dim=-1)  # [B, H, T_max]
    rows = [step[1, :, :31], step[2, :, :31], step[0, :, :31]]  # three layers' rows of a 31-token sequence
    for bounds in ([0, 31], [0, 4, 4, 20, 31], list(range(32))):
        want = chunk_masses(torch.cat(rows), bounds)
        got = chunk_mass_list(rows, bounds)
        assert isinstance(got, list) and all(isinstance(m, float) for m in got)
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, rtol=1e-6, atol=1e-7)
    for bad in ([0, 30], [1, 31], [0, 20, 10, 31], []):
        with pytest.raises(SignalError):
            chunk_mass_list(rows, bad)
    # a long context: chunks of every length around the kernel's 16-wide sums, one of 1,000 keys, against
    # sums in float64 (the kernels sum in double: 1e-12; the numpy path gives float32 masses)
    long = torch.softmax(torch.randn(2, 4, 1600, generator=g) * 4, dim=-1)
    lengths = [*range(34), 1000, 0, 5]
    bounds = [0, *itertools.accumulate(lengths)]
    rows = [long[0, :, : bounds[-1]], long[1, :, : bounds[-1]]]
    stacked = torch.cat(rows).double()
    want64 = torch.stack([stacked[:, a:b].sum(dim=1).mean() for a, b in itertools.pairwise(bounds)])
    got64 = torch.tensor(chunk_mass_list(rows, bounds), dtype=torch.float64)
    tight = kernel != "numpy"
    torch.testing.assert_close(got64, want64, rtol=1e-12 if tight else 1e-6, atol=1e-15 if tight else 1e-9)


def test_chunk_masses_low_precision_input_gives_float32() -> None:
    probs = torch.full((2, 8), 0.125, dtype=torch.bfloat16)
    out = chunk_masses(probs, [0, 2, 8])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.25, 0.75]))


@pytest.mark.parametrize("boundaries", [[1, 4], [0, 3], [0, 3, 2, 4], [], [[0, 4]], [0, 1.5, 4]])
def test_chunk_masses_rejects_bad_boundaries(boundaries: list[int]) -> None:
    with pytest.raises(SignalError):
        chunk_masses(torch.full((1, 4), 0.25), boundaries)


def test_chunk_masses_rejects_bad_probs_shape() -> None:
    with pytest.raises(SignalError):
        chunk_masses(torch.full((4,), 0.25), [0, 4])


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.1, 1.0),
)
def test_chunk_masses_property(heads: int, sizes: list[int], seed: int, scale: float) -> None:
    """Masses sum to the total mass averaged over heads, and each equals the per-chunk slice sum."""
    t = sum(sizes)
    if t == 0:
        sizes, t = [*sizes, 1], t + 1
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(heads, t, generator=g), dim=-1) * scale
    boundaries = [0]
    for n in sizes:
        boundaries.append(boundaries[-1] + n)
    masses = chunk_masses(probs, boundaries)
    assert masses.shape == (len(sizes),)
    assert float(masses.sum()) == pytest.approx(float(probs.sum()) / heads, abs=1e-5)
    for i, (lo, hi) in enumerate(itertools.pairwise(boundaries)):
        assert float(masses[i]) == pytest.approx(float(probs[:, lo:hi].sum()) / heads, abs=1e-5)


# ---- AttentionTracker ----


def ewma(observations: list[float], window: int = 64, decay: float = 0.95) -> float:
    """Reference: newest weight 1, then decay, decay^2 ... over the last ``window``, normalised."""
    last = observations[-window:][::-1]
    weights = [decay**k for k in range(len(last))]
    return sum(w * m for w, m in zip(weights, last, strict=True)) / sum(weights)


def test_ewma_exact_weights() -> None:
    tracker = AttentionTracker()
    for m in (0.1, 0.2, 0.4):
        tracker.observe({1: m})
    expected = (0.4 + 0.95 * 0.2 + 0.95**2 * 0.1) / (1 + 0.95 + 0.95**2)
    assert tracker.raw(1) == pytest.approx(expected, abs=1e-12)
    assert tracker.value(1) == pytest.approx(1.0)  # the only (so the most attended) chunk


def test_ewma_window_truncation_at_64() -> None:
    tracker = AttentionTracker()
    observations = [(i % 7) / 10 for i in range(70)]
    for m in observations:
        tracker.observe({5: m})
    assert tracker.raw(5) == pytest.approx(ewma(observations), abs=1e-12)
    assert tracker.raw(5) != pytest.approx(ewma(observations, window=70), abs=1e-6)  # older ones are gone
    small = AttentionTracker(window=2, decay=0.5)
    for m in (1.0, 0.0, 0.0):
        small.observe({1: m})
    assert small.raw(1) == 0.0  # the 1.0 fell out of the window
    small.observe({1: 0.3})
    assert small.raw(1) == pytest.approx((0.3 + 0.5 * 0.0) / 1.5)


def test_ewma_rescaled_by_max_and_partial_steps() -> None:
    tracker = AttentionTracker()
    tracker.observe({1: 0.2, 2: 0.4, 3: 0.0})
    assert (tracker.value(1), tracker.value(2), tracker.value(3)) == (0.5, 1.0, 0.0)
    tracker.observe({1: 0.6})  # only chunk 1 observed at this step; chunk 2 keeps its one observation
    r1 = (0.6 + 0.95 * 0.2) / 1.95
    assert tracker.raw(1) == pytest.approx(r1)
    assert tracker.value(1) == pytest.approx(1.0)
    assert tracker.value(2) == pytest.approx(0.4 / r1)
    assert tracker.value(4) is None


def test_cumulative_normalised_by_max() -> None:
    tracker = AttentionTracker(mode="cumulative")
    tracker.observe({1: 0.2, 2: 0.1})
    tracker.observe({1: 0.3, 2: 0.5})
    assert tracker.raw(1) == pytest.approx(0.5) and tracker.raw(2) == pytest.approx(0.6)
    assert tracker.value(1) == pytest.approx(0.5 / 0.6)
    assert tracker.value(2) == 1.0
    tracker.forget(2)
    assert tracker.value(2) is None and tracker.raw(2) is None
    assert tracker.value(1) == 1.0
    assert tracker.tracked() == [1]


def test_snapshot_replaces() -> None:
    tracker = AttentionTracker(mode="snapshot")
    tracker.observe({1: 0.2, 2: 0.4})
    tracker.observe({1: 0.1})
    assert tracker.raw(1) == pytest.approx(0.1) and tracker.raw(2) == pytest.approx(0.4)
    assert tracker.value(1) == pytest.approx(0.25) and tracker.value(2) == 1.0


def test_none_until_observed_forget_and_all_zero() -> None:
    tracker = AttentionTracker()
    assert tracker.value(1) is None and tracker.raw(1) is None
    tracker.observe({1: 0.0, 2: 0.0})
    assert tracker.value(1) == 0.0 and tracker.value(2) == 0.0
    tracker.forget(1)
    tracker.forget(99)  # unknown: no error
    assert tracker.value(1) is None
    tracker.observe({1: 0.3})
    assert tracker.raw(1) == pytest.approx(0.3)  # a fresh start, no old zeros


def test_tracker_validation() -> None:
    for bad in ({"mode": "h2o"}, {"window": 0}, {"decay": 0.0}, {"decay": 1.5}):
        with pytest.raises(ConfigError):
            AttentionTracker(**bad)
    tracker = AttentionTracker()
    for mass in (-0.1, float("nan"), float("inf")):
        with pytest.raises(SignalError):
            tracker.observe({1: mass})


class _DequeTracker:
    """The tracker as it was written first, one deque (or sum) per chunk: the reference for the array one."""

    def __init__(self, mode: str, window: int, decay: float) -> None:
        self.mode, self.window, self.decay = mode, window, decay
        self.history: dict[int, deque[float]] = {}
        self.sums: dict[int, float] = {}

    def observe(self, masses: dict[int, float]) -> None:
        for chunk_id, m in masses.items():
            if self.mode == "cumulative":
                self.sums[chunk_id] = self.sums.get(chunk_id, 0.0) + m
            else:
                maxlen = self.window if self.mode == "ewma" else 1
                self.history.setdefault(chunk_id, deque(maxlen=maxlen)).append(m)

    def forget(self, chunk_id: int) -> None:
        self.history.pop(chunk_id, None)
        self.sums.pop(chunk_id, None)

    def raw(self, chunk_id: int) -> float | None:
        if self.mode == "cumulative":
            return self.sums.get(chunk_id)
        if chunk_id not in self.history:
            return None
        num = den = 0.0
        weight = 1.0
        for m in reversed(self.history[chunk_id]):
            num += weight * m
            den += weight
            weight *= self.decay
        return num / den


@pytest.mark.parametrize("mode", ["ewma", "cumulative", "snapshot"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_array_tracker_equals_one_deque_per_chunk(mode: str, seed: int) -> None:
    """A session's life in steps: a resident set that grows, loses chunks (forgotten) and gets them back,
    and chunks forgotten while they stay resident (their positions changed meaning), observed every step in
    cache order. Every raw aggregate is bit for bit the per-chunk deque's, the rescaled values are those
    aggregates over the largest, and the tracked chunks are the deque's."""
    rng = random.Random(seed)
    window = rng.choice([1, 3, 64])
    tracker = AttentionTracker(mode=mode, window=window, decay=0.9)  # type: ignore[arg-type]
    ref = _DequeTracker(mode, window, 0.9)
    resident: list[int] = []
    next_id = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.1 or not resident:
            resident.append(next_id)
            next_id += 1
        elif action < 0.15:
            gone = resident.pop(rng.randrange(len(resident)))
            tracker.forget(gone)
            ref.forget(gone)
        elif action < 0.17:
            stays = rng.choice(resident)  # its positions changed meaning: forgotten, still resident
            tracker.forget(stays)
            ref.forget(stays)
        elif action < 0.2 and next_id:
            back = rng.randrange(next_id)  # a chunk coming back (or one still resident: kept once)
            if back not in resident:
                resident.insert(rng.randrange(len(resident) + 1), back)
        masses = [rng.choice([0.0, rng.random(), rng.random() / 1000]) for _ in resident]
        tracker.observe_ids(list(resident), masses)
        ref.observe(dict(zip(resident, masses, strict=True)))
        for chunk_id in range(next_id):
            assert tracker.raw(chunk_id) == ref.raw(chunk_id)
    raws = {c: r for c in range(next_id) if (r := ref.raw(c)) is not None}
    top = max(raws.values())
    for chunk_id, r in raws.items():
        assert tracker.value(chunk_id) == (r / top if top > 0 else 0.0)
    assert sorted(tracker.tracked()) == sorted(raws)


def test_a_bad_mass_records_nothing_and_each_chunk_is_observed_once() -> None:
    tracker = AttentionTracker()
    tracker.observe_ids([1, 2], [0.5, 0.25])
    for ids, masses in (([1, 2, 3], [0.1, float("nan"), 0.2]), ([1, 2], [0.1, -1e-9])):
        with pytest.raises(SignalError, match="attention mass of chunk 2"):
            tracker.observe_ids(ids, masses)
    assert (tracker.raw(1), tracker.raw(2), tracker.raw(3)) == (0.5, 0.25, None)
    with pytest.raises(SignalError, match="once"):
        tracker.observe_ids([1, 1], [0.1, 0.2])
    with pytest.raises(SignalError, match="2 chunks"):
        tracker.observe_ids([1, 2], [0.1])
    assert tracker.history(1) == [0.5]


@pytest.mark.parametrize("mode", ["ewma", "cumulative", "snapshot"])
def test_a_saved_tracker_keeps_its_json_and_loads_back(mode: str) -> None:
    """The saved form is the one sessions on disk hold (ids as strings; histories oldest first, at most a
    window; cumulative: the sums), and a tracker loaded from it aggregates as the saved one did."""
    from kvos.session.fields import load_tracker, tracker_state

    tracker = AttentionTracker(mode=mode, window=2, decay=0.5)  # type: ignore[arg-type]
    for masses in ({7: 0.5, 3: 0.25}, {7: 0.125}, {7: 1.0, 3: 0.0}):
        tracker.observe(masses)
    state = tracker_state(tracker)
    want = {
        "ewma": {"history": {"7": [0.125, 1.0], "3": [0.25, 0.0]}, "cumulative": {}},
        "snapshot": {"history": {"7": [1.0], "3": [0.0]}, "cumulative": {}},
        "cumulative": {"history": {}, "cumulative": {"7": 1.625, "3": 0.25}},
    }[mode]
    assert state == want
    loaded = AttentionTracker(mode=mode, window=2, decay=0.5)  # type: ignore[arg-type]
    load_tracker(loaded, json.loads(json.dumps(state)))
    for t in (tracker, loaded):
        t.observe({3: 0.5, 9: 0.75})
    assert [loaded.raw(c) for c in (7, 3, 9)] == [tracker.raw(c) for c in (7, 3, 9)]
    assert loaded.tracked() == tracker.tracked() == [7, 3, 9]
    loaded.load({5: [], 6: [0.5]})  # a chunk with no observation is not tracked
    assert loaded.tracked() == [6] and loaded.raw(5) is None


@pytest.mark.parametrize("kernel", ["native", "avx2", "portable"])
@pytest.mark.parametrize("mode", ["ewma", "cumulative", "snapshot"])
def test_a_steps_probabilities_observed_in_the_kernel_as_through_the_masses(
    kernel: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """observe_probs in one call of the decode kernel (each build) records what observe_ids records of
    chunk_mass_list's masses, bit for bit, while the resident chunks change and the rows grow; a NaN
    probability or bad boundaries raise SignalError and record nothing, not even the new chunk."""
    from kvos.model import decode_kernel
    from kvos.policy import attention
    from kvos.policy.attention import chunk_mass_list

    built = decode_kernel.BUILDS[kernel]()
    if built is None:
        pytest.skip(f"the decode kernel's {kernel} build is not made here (no compiler, or disabled)")
    g = torch.Generator().manual_seed(5)
    fast = AttentionTracker(mode=mode, window=3, decay=0.9)  # type: ignore[arg-type]
    slow = AttentionTracker(mode=mode, window=3, decay=0.9)  # type: ignore[arg-type]
    resident = [4, 9]
    for step in range(30):
        if step % 4 == 3:
            resident.append(100 + step)  # a new chunk (the rows grow past 8)
        if step % 7 == 6:
            gone = resident.pop(1)
            fast.forget(gone)
            slow.forget(gone)
        lengths = [int(n) for n in torch.randint(0, 40, (len(resident),), generator=g)]
        bounds = [0, *itertools.accumulate(lengths)]
        probs = [
            torch.softmax(torch.randn(3, bounds[-1] + 1, generator=g), -1)[:, : bounds[-1]] for _ in range(2)
        ]
        monkeypatch.setattr(decode_kernel, "kernel", lambda: built)
        with monkeypatch.context() as inside:  # the kernel's call alone: no way back to the masses' list
            inside.setattr(attention, "chunk_mass_list", _fell_back)
            fast.observe_probs(probs, bounds, list(resident))
        slow.observe_ids(list(resident), chunk_mass_list(probs, bounds))
        for chunk_id in {*resident, 4, 9}:
            assert fast.history(chunk_id) == slow.history(chunk_id)
            assert fast.raw(chunk_id) == slow.raw(chunk_id)
    before = {c: fast.history(c) for c in resident}
    bad = [torch.full((2, 10), 0.1), torch.full((2, 10), 0.1)]
    bad[1][0, 7] = float("nan")
    with pytest.raises(SignalError, match="attention mass of chunk 77"):
        fast.observe_probs(bad, [0, 5, 10], [resident[0], 77])
    with pytest.raises(SignalError, match="boundaries"):
        fast.observe_probs(bad, [0, 5, 9], [resident[0], 78])
    assert {c: fast.history(c) for c in resident} == before
    assert fast.raw(77) is None and fast.raw(78) is None and 77 not in fast.tracked()


def _fell_back(*_: object) -> list[float]:
    raise AssertionError("observe_probs fell back to chunk_mass_list")
