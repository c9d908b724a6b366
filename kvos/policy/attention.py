"""The attention signal: how much attention the model puts on each resident chunk.

:func:`chunk_masses` turns one query's attention probabilities over the cache into per-chunk masses;
:class:`AttentionTracker` aggregates those masses over decode steps (EWMA, cumulative H2O-like, or a
SnapKV-like snapshot) and hands the scorer a value in [0, 1] per chunk.
"""

from __future__ import annotations

import math
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


@dataclass(eq=False)
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

    Every tracked chunk is a row of one float64 array: its last observations in a ring (``ewma``: ``window``
    of them, ``snapshot``: one) or its running sum (``cumulative``). A decode step's observation
    (:meth:`observe_probs`) is then one call of the decode kernel, which sums the captured probabilities per
    chunk and writes the masses into the rows, whatever the number of chunks: a Python update per chunk cost
    ~0.3 us each (64 chunks: 20 us a token), and a few numpy operations ~10 us each from the cold caches a
    decode step leaves.
    """

    mode: TrackerMode = "ewma"
    window: int = 64
    decay: float = 0.95
    _rows: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # chunk id -> its row
    _free: list[int] = field(default_factory=list, init=False, repr=False)  # rows of forgotten chunks
    # float64 [rows, depth]: each row's ring of observations, or its sum (cumulative: depth 1)
    _values: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)), init=False, repr=False)
    _seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False)
    # the last step's chunk ids and their rows (numpy, and torch for the kernel)
    _last: tuple[list[int], np.ndarray, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _tensors: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _normalised: dict[int, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in TRACKER_MODES:
            raise ConfigError(f"AttentionTracker.mode must be one of {TRACKER_MODES}, got {self.mode!r}")
        if self.window < 1:
            raise ConfigError(f"AttentionTracker.window must be >= 1, got {self.window}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"AttentionTracker.decay must be in (0, 1], got {self.decay}")
        self._values = np.zeros((0, self.depth))

    @property
    def depth(self) -> int:
        """The observations a row keeps: ``window`` (ewma), else one (the latest, or the sum)."""
        return self.window if self.mode == "ewma" else 1

    def observe(self, masses: Mapping[int, float]) -> None:
        """Record one decode step: ``chunk_id -> mass`` (averaged over captured layers and heads)."""
        self.observe_ids(list(masses), list(masses.values()))

    def observe_probs(self, probs: list[torch.Tensor], boundaries: list[int], chunk_ids: list[int]) -> None:
        """Record one decode step from its captured attention: ``probs`` each ``[heads, T]`` (the captured
        layers), ``boundaries`` the resident chunks' ``[0, ..., T]``, ``chunk_ids`` those chunks in cache
        order; the masses of :func:`chunk_mass_list`. In one call of the decode kernel where it is built and
        the probabilities are float32 on the CPU; otherwise, and for any input it refuses (whose errors then
        name the fault), through :meth:`observe_ids`."""
        built = decode_kernel.kernel()
        if (
            built is not None
            and chunk_ids
            and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in probs)
        ):
            rows, rows_t = self._rows_of(chunk_ids)
            values, seen = self._as_tensors()
            try:
                bad = built.observe_masses(probs, boundaries, values, seen, rows_t, self.mode == "cumulative")
            except (ValueError, RuntimeError, TypeError, IndexError):
                bad = 0
            if bad < 0:
                self._normalised = None
                return
            # a chunk given a row for this step alone (its mass refused) is untracked again; found in one
            # pass, not a Python loop over every resident chunk each token
            for index in np.flatnonzero(self._seen[rows] == 0).tolist():
                self.forget(chunk_ids[index])
        self.observe_ids(chunk_ids, chunk_mass_list(probs, boundaries))

    def observe_ids(self, chunk_ids: list[int], masses: Sequence[float] | np.ndarray) -> None:
        """:meth:`observe` of ``masses[i]`` for the distinct ``chunk_ids[i]``: a session's resident chunks
        in cache order, whose rows are found again at once while that order holds. A mass that is not
        finite and >= 0 raises :class:`SignalError` before anything is recorded."""
        values = np.asarray(masses, dtype=np.float64)
        if values.shape != (len(chunk_ids),):
            raise SignalError(f"{len(chunk_ids)} chunks observed with masses of shape {values.shape}")
        if not chunk_ids:
            self._normalised = None
            return
        # two reductions: a NaN or -inf makes the minimum fail the test, a +inf the sum
        if not (values.min() >= 0.0 and math.isfinite(values.sum())):
            bad = ~(np.isfinite(values) & (values >= 0.0))
            if bad.any():
                at = int(bad.argmax())
                chunk_id, got = chunk_ids[at], float(values[at])
                raise SignalError(f"attention mass of chunk {chunk_id} must be finite and >= 0, got {got}")
        rows, _ = self._rows_of(chunk_ids)
        if self.mode == "cumulative":
            self._values[rows, 0] += values
        else:
            self._values[rows, self._seen[rows] % self.depth] = values
        self._seen[rows] += 1
        self._normalised = None

    def _rows_of(self, chunk_ids: list[int]) -> tuple[np.ndarray, torch.Tensor]:
        """int64 [n]: the rows of ``chunk_ids``, new chunks given one, and the same as a tensor sharing their
        memory (for the kernel); the last step's, while its chunks are unchanged."""
        if self._last is None or self._last[0] != chunk_ids:
            if len(set(chunk_ids)) != len(chunk_ids):
                raise SignalError(f"a step observes each chunk once, got {chunk_ids}")
            rows = np.fromiter((self._row(c) for c in chunk_ids), dtype=np.int64, count=len(chunk_ids))
            self._last = (list(chunk_ids), rows, torch.from_numpy(rows))
        return self._last[1], self._last[2]

    def _as_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' values and counts as tensors sharing the arrays' memory (made again after a growth)."""
        if self._tensors is None:
            self._tensors = (torch.from_numpy(self._values), torch.from_numpy(self._seen))
        return self._tensors

    def _row(self, chunk_id: int) -> int:
        """The chunk's row, a fresh (zeroed) one if it is not tracked."""
        row = self._rows.get(chunk_id)
        if row is not None:
            return row
        if not self._free:
            grown = max(8, 2 * len(self._seen))
            self._free = list(range(grown - 1, len(self._seen) - 1, -1))
            self._values = np.concatenate([self._values, np.zeros((grown - len(self._seen), self.depth))])
            self._seen = np.concatenate([self._seen, np.zeros(grown - len(self._seen), np.int64)])
            self._tensors = None
        row = self._free.pop()
        self._values[row] = 0.0
        self._seen[row] = 0
        self._rows[chunk_id] = row
        return row

    def raw(self, chunk_id: int) -> float | None:
        """The chunk's aggregate before rescaling (ewma mean, running sum, latest mass); ``None``: unseen."""
        row = self._rows.get(chunk_id)
        if row is None:
            return None
        if self.mode == "cumulative":
            return float(self._values[row, 0])
        num = den = 0.0
        weight = 1.0
        for m in self.history(chunk_id)[::-1]:  # newest first
            num += weight * m
            den += weight
            weight *= self.decay
        return num / den

    def history(self, chunk_id: int) -> list[float]:
        """The chunk's kept observations, oldest first (ewma, snapshot; [] when untracked), or [its sum]."""
        row = self._rows.get(chunk_id)
        if row is None:
            return []
        seen, depth = int(self._seen[row]), self.depth
        if self.mode == "cumulative":
            return [float(self._values[row, 0])]
        return [float(self._values[row, i % depth]) for i in range(max(0, seen - depth), seen)]

    def load(self, histories: Mapping[int, Sequence[float]]) -> None:
        """Track exactly these chunks with these observations, oldest first (each :meth:`history`; for
        ``cumulative``, [its sum]): a saved session's tracker, restored. A chunk with none stays untracked."""
        self._rows, self._free, self._last, self._normalised = {}, [], None, None
        self._values, self._seen, self._tensors = np.zeros((0, self.depth)), np.zeros(0, np.int64), None
        for chunk_id, observations in histories.items():
            kept = [float(m) for m in observations][-self.depth :]
            if not kept:
                continue
            row = self._row(int(chunk_id))
            self._seen[row] = len(kept)
            for i, m in enumerate(kept):
                self._values[row, i] = m

    def value(self, chunk_id: int) -> float | None:
        """The chunk's aggregate divided by the largest over tracked chunks, in [0, 1]; ``None`` if unseen."""
        if self._normalised is None:
            self._normalised = self._rescaled()
        return self._normalised.get(chunk_id)

    def forget(self, chunk_id: int) -> None:
        """Drop everything known about a chunk (evicted, or its positions changed meaning)."""
        row = self._rows.pop(chunk_id, None)
        if row is not None:
            self._free.append(row)
            self._last = None
        self._normalised = None

    def tracked(self) -> list[int]:
        """Ids of the chunks observed at least once and not forgotten."""
        return list(self._rows)

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
