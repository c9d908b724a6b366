"""A model's attention entropy per layer and query head, measured on calibration texts (``kvos calibrate``;
the per-head budgets of :mod:`kvos.policy.entropy` read it)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from tqdm import tqdm

from kvos.engine.engine import Engine
from kvos.policy.entropy import QUERY_FRACTIONS, entropy_bits, query_indices


def text_entropies(engine: Engine, ids: Sequence[int], progress: tqdm | None = None) -> torch.Tensor:
    """Mean attention entropy in bits of the query tokens of ``ids`` (see :func:`query_indices`), per layer
    and query head: float64 ``[num_layers, num_heads]``. Uses and releases a fresh sequence."""
    layers = frozenset(range(engine.model.config.num_kv_layers))
    seq = engine.new_sequence()
    rows, start = [], 0
    try:
        for q in query_indices(len(ids), QUERY_FRACTIONS):
            captured: dict[int, torch.Tensor] = {}
            engine.extend(seq, ids[start : q + 1], capture_layers=layers, captured=captured, capture_window=1)
            rows.append(torch.stack([entropy_bits(captured[layer].cpu()) for layer in sorted(layers)]))
            start = q + 1
            if progress is not None:
                progress.update(1)
    finally:
        engine.release(seq)
    return torch.stack(rows).mean(dim=0)


def calibrate(engine: Engine, texts: Sequence[Sequence[int]], show_progress: bool = True) -> torch.Tensor:
    """Entropy per layer and query head averaged over ``texts`` (each weighted alike): float64 ``[L, H]``."""
    total = sum(len(query_indices(len(ids))) for ids in texts)
    with (
        torch.inference_mode(),
        tqdm(total=total, desc="calibrate", unit="query", file=sys.stderr, disable=not show_progress) as bar,
    ):
        return torch.stack([text_entropies(engine, ids, bar) for ids in texts]).mean(dim=0)
