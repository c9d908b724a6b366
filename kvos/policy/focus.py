"""The task focus: a running embedding of what the conversation is about now, for the coherence signal."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvos.errors import ConfigError, SignalError
from kvos.policy.signals import cosine


def _unit(v: torch.Tensor) -> torch.Tensor:
    """``v`` as a float32 unit vector ``[dim]``; :class:`SignalError` for a zero or non-finite vector."""
    v32 = v.detach().reshape(-1).float()
    norm = float(v32.norm())
    if not norm > 0.0 or norm == float("inf"):
        raise SignalError(f"a focus embedding must have a finite, non-zero norm, got {norm}")
    return v32 / norm


@dataclass
class TaskFocus:
    """The focus vector, updated with each user message's embedding.

    The first :meth:`update` sets it. A message whose cosine to the focus is below ``snap_below``, or one
    flagged as a task boundary, snaps the focus to it. Otherwise ``focus = keep * focus + (1 - keep) * new``.
    ``vector`` is stored as a float32 unit vector: each new embedding is normalised before mixing and the mix
    is renormalised, so every message counts by its direction, not its norm (cosine is scale-invariant).
    """

    snap_below: float = 0.3
    keep: float = 0.7
    vector: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not -1.0 <= self.snap_below <= 1.0:
            raise ConfigError(f"TaskFocus.snap_below must be in [-1, 1], got {self.snap_below}")
        if not 0.0 <= self.keep <= 1.0:
            raise ConfigError(f"TaskFocus.keep must be in [0, 1], got {self.keep}")
        if self.vector is not None:
            self.vector = _unit(self.vector)

    def similarity(self, embedding: torch.Tensor) -> float | None:
        """Cosine of ``embedding`` to the focus; ``None`` before the first update."""
        return None if self.vector is None else cosine(embedding, self.vector)

    def update(self, embedding: torch.Tensor, boundary: bool = False) -> bool:
        """Fold a new message's embedding ``[dim]`` into the focus.

        Returns ``True`` when the focus was set to the new embedding (first call, ``boundary``, or cosine
        below ``snap_below``), ``False`` when it was mixed in by the EMA.
        """
        new = _unit(embedding)
        if self.vector is None or boundary:
            self.vector = new
            return True
        if self.vector.shape != new.shape:
            raise SignalError(f"focus has shape {tuple(self.vector.shape)}, embedding {tuple(new.shape)}")
        new = new.to(self.vector.device)
        if float(self.vector @ new) < self.snap_below:
            self.vector = new
            return True
        mixed = self.keep * self.vector + (1.0 - self.keep) * new
        norm = float(mixed.norm())
        self.vector = mixed / norm if norm > 0.0 else new
        return False
