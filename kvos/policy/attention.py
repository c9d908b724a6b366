"""The attention signal: how much attention the model puts on each resident chunk.

:func:`chunk_masses` turns one query's attention probabilities over the cache into per-chunk masses;
:class:`AttentionTracker` aggregates those masses over decode steps (EWMA, cumulative H2O-like, or a
SnapKV-like snapshot) and hands the scorer a value in [0, 1] per chunk.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

import numpy as np
import torch

from kvos.errors import ConfigError, SignalError
from kvos.model import decode_kernel

TrackerMode = Literal["ewma", "cumulative", "snapshot"]
TRACKER_MODES: tuple[str, ...] = ("ewma", "cumulative", "snapshot")


def chunk_masses(probs: torch.Tensor, boundaries: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per-chunk attention mass of one query, averaged over heads.

    ``probs``: float ``[heads, T]``, one query's attention over the ``T`` cached keys of one layer, in cache
    order. ``boundaries``: cumulative token offsets ``[0, b1, ..., T]`` of the resident chunks in cache order
    (non-decreasing). Returns float32 ``[num_chunks]`` on ``probs``' device: chunk ``i`` gets
    ``mean_h sum(probs[h, b_i:b_{i+1}])``. One cumsum (float64) and two gathers, no Python loop over tokens.
    """
    if probs.dim() != 2:
        raise SignalError(f"probs must be [heads, T], got shape {tuple(probs.shape)}")
    t = probs.shape[1]
    bounds = boundaries.tolist() if isinstance(boundaries, torch.Tensor) else list(boundaries)
    if (
        not bounds
        or not all(isinstance(x, int | np.integer) for x in bounds)
        or bounds[0] != 0
        or bounds[-1] != t
    ):
        raise SignalError(f"boundaries must be [0, ..., {t}] (T = probs.shape[1]), got {bounds}")
    if any(b < a for a, b in pairwise(bounds)):
        raise SignalError(f"boundaries must be non-decreasing, got {bounds}")
    # in numpy: this runs once per decoded token, where a torch operator's dispatch costs more than its math
    per_token = probs.detach().float().cpu().numpy().mean(axis=0)  # the head mean commutes with the sums
    cs = np.concatenate([np.zeros(1), np.cumsum(per_token, dtype=np.float64)])
    b = np.asarray(bounds, dtype=np.int64)
    masses = np.maximum(cs[b[1:]] - cs[b[:-1]], 0.0).astype(np.float32)
    return torch.from_numpy(masses).to(probs.device)


def chunk_mass_list(rows: Sequence[torch.Tensor], boundaries: list[int]) -> list[float]:
    """:func:`chunk_masses` of the rows of ``rows`` (each ``[heads, T]``: the captured layers of one decode
    step) stacked together, as Python floats: what a session observes every decoded token.

    The decode kernel's ``chunk_masses`` where it is built and the rows are float32 on the CPU: one call
    instead of a concatenation and five numpy operations, which cost ~13 us a token from a warm cache and
    ~150 us from the cold one every decode step leaves behind (the step streams the weights through every
    cache level; docs/benchmarks.md). Otherwise, and for any input the kernel refuses, :func:`chunk_masses`
    (whose errors name what was wrong)."""
    built = decode_kernel.kernel()
    if built is not None and all(r.dtype == torch.float32 and r.device.type == "cpu" for r in rows):
        try:
            return list(built.chunk_masses(list(rows), boundaries))
        except (ValueError, RuntimeError, TypeError):
            pass  # the checks below say what was wrong
    return chunk_masses(torch.cat(list(rows)), boundaries).tolist()


@dataclass
class AttentionTracker:
    """Aggregates per-chunk attention masses over decode steps.

    - ``ewma`` (default): weighted mean of the chunk's last ``window`` observations, the newest with weight 1,
      the one before ``decay``, then ``decay**2`` ..., normalised by the sum of the weights used.
    - ``cumulative`` (H2O-like): the running sum of the chunk's masses.
    - ``snapshot`` (SnapKV-like): the chunk's latest observation replaces the previous ones; use it for an
      observation-window snapshot taken at prefill.

    A chunk gets an observation only at the steps whose ``masses`` contain it (pass every resident chunk,
    zeros included). :meth:`value` rescales: it divides the chunk's aggregate by the largest aggregate over
    the tracked chunks, so the most-attended chunk scores 1.0 and every value lies in [0, 1] (all 0.0 when
    every aggregate is 0). For ``cumulative`` this is the normalisation by the running max; for ``ewma`` and
    ``snapshot`` it makes masses comparable with the scorer's other signals. :meth:`raw` gives the aggregate.
    """

    mode: TrackerMode = "ewma"
    window: int = 64
    decay: float = 0.95
    _history: dict[int, deque[float]] = field(default_factory=dict, init=False, repr=False)
    _cumulative: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _normalised: dict[int, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in TRACKER_MODES:
            raise ConfigError(f"AttentionTracker.mode must be one of {TRACKER_MODES}, got {self.mode!r}")
        if self.window < 1:
            raise ConfigError(f"AttentionTracker.window must be >= 1, got {self.window}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"AttentionTracker.decay must be in (0, 1], got {self.decay}")

    def observe(self, masses: Mapping[int, float]) -> None:
        """Record one decode step: ``chunk_id -> mass`` (averaged over captured layers and heads)."""
        for chunk_id, mass in masses.items():
            m = float(mass)
            if not (math.isfinite(m) and m >= 0.0):
                raise SignalError(f"attention mass of chunk {chunk_id} must be finite and >= 0, got {m}")
            if self.mode == "cumulative":
                self._cumulative[chunk_id] = self._cumulative.get(chunk_id, 0.0) + m
            else:
                maxlen = self.window if self.mode == "ewma" else 1
                self._history.setdefault(chunk_id, deque(maxlen=maxlen)).append(m)
        self._normalised = None

    def raw(self, chunk_id: int) -> float | None:
        """The chunk's aggregate before rescaling (ewma mean, running sum, latest mass); ``None``: unseen."""
        if self.mode == "cumulative":
            return self._cumulative.get(chunk_id)
        history = self._history.get(chunk_id)
        if history is None:
            return None
        num = den = 0.0
        weight = 1.0
        for m in reversed(history):  # newest first
            num += weight * m
            den += weight
            weight *= self.decay
        return num / den

    def value(self, chunk_id: int) -> float | None:
        """The chunk's aggregate divided by the largest over tracked chunks, in [0, 1]; ``None`` if unseen."""
        if self._normalised is None:
            self._normalised = self._rescaled()
        return self._normalised.get(chunk_id)

    def forget(self, chunk_id: int) -> None:
        """Drop everything known about a chunk (evicted, or its positions changed meaning)."""
        self._history.pop(chunk_id, None)
        self._cumulative.pop(chunk_id, None)
        self._normalised = None

    def tracked(self) -> list[int]:
        """Ids of the chunks observed at least once and not forgotten."""
        return list(self._cumulative if self.mode == "cumulative" else self._history)

    def _rescaled(self) -> dict[int, float]:
        raws: dict[int, float] = {}
        for chunk_id in self.tracked():
            r = self.raw(chunk_id)
            assert r is not None
            raws[chunk_id] = r
        top = max(raws.values(), default=0.0)
        if top <= 0.0:
            return dict.fromkeys(raws, 0.0)
        return {chunk_id: r / top for chunk_id, r in raws.items()}
