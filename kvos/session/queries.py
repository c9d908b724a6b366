"""The queries of a new user message, tapped during its prefill for the "attention" recovery signal."""

from __future__ import annotations

import torch

from kvos.model.rope import LayerRopes
from kvos.policy.digest import unrotate


class QueryTap:
    """Collects the queries of chosen layers over several forward passes (a message prefilled chunk by chunk,
    each chunk at its own positions: paging between chunks may move the cache) and hands back the last ones
    rotated back to position 0. ``layers`` empty: nothing is tapped (``wanted`` is empty)."""

    def __init__(self, layers: tuple[int, ...], ropes: LayerRopes) -> None:
        self.layers, self.ropes = layers, ropes
        self.passes: list[tuple[dict[int, torch.Tensor], torch.Tensor]] = []

    @property
    def wanted(self) -> frozenset[int]:
        return frozenset(self.layers)

    def add(self, positions: torch.Tensor) -> dict[int, torch.Tensor]:
        """A dict for the engine to fill with one forward pass's queries (layer -> [n, heads, head_dim]) at
        ``positions`` (int64 [n])."""
        queries: dict[int, torch.Tensor] = {}
        self.passes.append((queries, positions))
        return queries

    def take(self, window: int) -> torch.Tensor:
        """The last ``window`` queries tapped since the last take, rotated back to position 0: float32
        ``[layers, n, heads, head_dim]``; the tap is emptied."""
        passes, self.passes = self.passes, []
        per_layer = []
        for layer in self.layers:
            parts = [unrotate(q[layer], pos, self.ropes[layer]) for q, pos in passes if layer in q]
            per_layer.append(torch.cat(parts)[-window:])
        return torch.stack(per_layer)
