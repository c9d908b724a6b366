"""The attention signal: per-chunk masses from attention probabilities, and the tracker's three modes."""

from __future__ import annotations

import itertools

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


@pytest.mark.parametrize("kernel", ["native", "portable", "numpy"])
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
