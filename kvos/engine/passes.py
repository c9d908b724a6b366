"""Who runs a forward pass: a request's work asks for its passes the same way alone and under the
scheduler. The engine hands every pass to the runner of the running context (:func:`current_runner`): by
default the engine's own :class:`DirectRunner`, which runs it at once; on a scheduler's worker the
scheduler, which installs itself there (:func:`runs_passes`) and batches the pass with other sessions'
into its next step. Nothing below the scheduler knows it exists."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch

from kvos.engine import logit_stats
from kvos.memory.pool import KVPool
from kvos.model.attention import BatchItem
from kvos.model.transformer import NO_STORE, Transformer


class PassRunner(Protocol):
    """Runs forward passes and returns, per item, what ``Transformer.forward_batch`` would for it alone,
    each row of last-token logits with its :mod:`~kvos.engine.logit_stats` attached."""

    def forward_many(self, items: list[BatchItem], standalone: bool = False) -> list[torch.Tensor]:
        """The items' outputs; ``standalone``: fresh passes that read and write no pool (embeddings)."""
        ...

    @property
    def slice_tokens(self) -> int | None:
        """The most tokens one prefill slice may carry here (None: no limit of the runner's own)."""
        ...


class DirectRunner:
    """Runs each pass at once, on the calling thread, over ``model`` and ``pool``."""

    def __init__(self, model: Transformer, pool: KVPool) -> None:
        self.model, self.pool = model, pool

    def forward_many(self, items: list[BatchItem], standalone: bool = False) -> list[torch.Tensor]:
        if not items:
            return []
        outputs = self.model.forward_batch(items, NO_STORE if standalone else self.pool)
        logit_stats.attach(items, outputs)
        return outputs

    @property
    def slice_tokens(self) -> int | None:
        return None


_RUNNER: ContextVar[PassRunner | None] = ContextVar("kvos_pass_runner", default=None)


def current_runner() -> PassRunner | None:
    """The runner installed in this context (:func:`runs_passes`), or None."""
    return _RUNNER.get()


@contextmanager
def runs_passes(runner: PassRunner) -> Iterator[None]:
    """Within the block, this context's forward passes go to ``runner``."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)
