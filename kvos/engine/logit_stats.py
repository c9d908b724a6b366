"""What a forward pass tells a token's pick about each row of logits it returns: the largest logit, the first
token holding it and the log-softmax normaliser.

A session picks its next token (:class:`~kvos.engine.sampling.Sampler`) and, when asked, its log-probability
(:func:`~kvos.engine.sampling.token_logprob`) from its row of logits, between two steps, where every read of
the row's 49,152-151,936 floats comes from memory the step's weights have just evicted (a pass over them cost
18-85 us there, against 5 us from a warm cache). The pass runners (:mod:`kvos.engine.passes`) instead
compute these three numbers for every row of a step at once, right after the forward pass and on its
threads (:func:`attach`: the decode kernel's ``row_stats``), and the pick reads them (:func:`of`).

The numbers ride on the logits tensor the runner returns (an attribute of that tensor object, so they go
where it goes and no further: a view or a copy has none). They describe the row as the pass returned it:
code that changes a row in place must give the row back as it was (the sampler's in-place bias does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvos.model import decode_kernel
from kvos.model.attention import BatchItem

_ATTRIBUTE = "_kvos_logit_stats"


@dataclass(frozen=True)
class LogitStats:
    """One row of logits: ``top`` the largest value (finite), ``best`` the first token id holding it, and
    ``normaliser`` log sum exp of the row (float64 sums of float32 exponentials, as
    :func:`~kvos.engine.sampling.log_normaliser` computes it)."""

    top: float
    best: int
    normaliser: float


def attach(items: Sequence[BatchItem], outputs: Sequence[torch.Tensor]) -> None:
    """Compute :class:`LogitStats` for every output that is one row of last-token logits (float32, CPU) and
    attach them to it: all rows in one parallel kernel call. Nothing where the decode kernel is not built;
    a row with a NaN or an infinite largest logit gets none (the pick's own path handles it)."""
    rows = [
        out
        for item, out in zip(items, outputs, strict=True)
        if item.logits == "last"
        and out.dim() == 2
        and out.shape[0] == 1
        and out.dtype == torch.float32
        and out.device.type == "cpu"
        and out.is_contiguous()
    ]
    built = decode_kernel.kernel() if rows else None
    if built is None:
        return
    for row, (top, best, normaliser) in zip(rows, built.row_stats(rows).tolist(), strict=True):
        if math.isfinite(top):
            setattr(row, _ATTRIBUTE, LogitStats(top, int(best), normaliser))


def of(logits: torch.Tensor) -> LogitStats | None:
    """The stats a pass runner attached to ``logits`` (the very tensor it returned), else None."""
    return getattr(logits, _ATTRIBUTE, None)
