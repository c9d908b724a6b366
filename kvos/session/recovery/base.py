"""The recovery signal's contract: how a session compares what is out of its cache with a new user message.

Each signal is one class (a module of its own in this package), chosen once when the session is made
(:func:`~kvos.session.recovery.factory.signal_class`). What a signal needs of the session is declared by
its class attributes, read before the session exists (a request's reservation, the session's taps); what
it does is score candidate chunks (:meth:`RecoverySignal.similarity`). Bringing the chosen ones back is
the memory's (:meth:`~kvos.session.memory.SessionMemory.bring_back`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from kvos.policy.chunks import Chunk
from kvos.session.units import Unit, by_message, exchange_units

if TYPE_CHECKING:
    from kvos.policy.retriever import Retriever
    from kvos.session.memory import SessionMemory
    from kvos.session.relevance import AnswerContrast

Similarity = Callable[[Chunk], float | None]
"""A chunk -> its score against the new message; None: not a candidate."""


class RecoverySignal:
    """Scores a session's chunks against a new user message for similarity recovery.

    Class attributes (what the session provides a signal of this class):
      name: the signal's name (``--recovery-signal``).
      bar: the default least score of a chunk that comes back (measured on the recall benchmark).
      exchanges: candidates are exchanges (:func:`~kvos.session.units.exchange_units`): resident ones
        compete too, and a chosen one's resident chunks are held for the turn; else messages, saved only.
      digests: reads key digests of the chunks (:attr:`Pager.digest_layers`).
      taps_message: recovers after the new message's prefill, from its queries (:meth:`after_message`).
      scratch: runs scratch forward passes (an :class:`AnswerContrast`; reserved at admission).
      needs_retriever: scores through the session's calibrated :class:`Retriever`.
    """

    name: ClassVar[str]
    bar: ClassVar[float] = 0.0
    exchanges: ClassVar[bool] = False
    digests: ClassVar[bool] = False
    taps_message: ClassVar[bool] = False
    scratch: ClassVar[bool] = False
    needs_retriever: ClassVar[bool] = False

    def __init__(self, memory: SessionMemory, answer: AnswerContrast | None = None) -> None:
        """``answer``: the scratch scorer, given exactly when the class declares ``scratch``."""
        if self.scratch != (answer is not None):
            need = "needs" if self.scratch else "takes no"
            raise ValueError(f"the {self.name} signal {need} answer scorer")
        self.memory, self.answer = memory, answer
        # called with a new user message's token ids before recovery (kvos calibrate --retriever)
        self.recovery_observer: Callable[[list[int]], None] | None = None
        # called with the message's chunks and its tapped queries before a tapping signal scores
        # (kvos calibrate --retrieval watches the probe turns)
        self.queries_observer: Callable[[list[Chunk], torch.Tensor], None] | None = None

    @classmethod
    def default_bar(cls, retriever: Retriever | None) -> float:
        """The least score that brings a chunk back when the config names none."""
        return cls.bar

    @property
    def active(self) -> bool:
        """Whether recovery runs at all: never with the discard backend or a ``recovery_top_k`` of 0."""
        config = self.memory.config
        return config.backend != "discard" and config.recovery_top_k > 0

    # ------------------------------------------------------------------ turns
    def before_message(self, ids: list[int], query: torch.Tensor, incoming_locked: int = 0) -> None:
        """Bring back the saved (or breadcrumbed) units most similar to the new user message ``ids``
        (embedded as ``query``), best last, before it is prefilled. ``incoming_locked``: tokens of the new
        message that will stay locked (a pinned message), so the recovered chunks leave room for them.

        With exchanges as units, resident ones compete too, and a chosen exchange's resident chunks are
        protected for the turn, so making room for the new message cannot page out what its answer needs
        (nor half of an exchange brought back)."""
        if self.recovery_observer is not None:
            self.recovery_observer(ids)
        memory = self.memory
        chunks = memory.chunks.values()
        if not self.active or not any(memory.recoverable(c) for c in chunks):
            return
        eligible = memory.eligible if self.exchanges else memory.recoverable
        unit = self.unit()
        similarity = self.similarity(ids, query, unit)
        sims = {c.chunk_id: s for c in chunks if eligible(c) and (s := similarity(c)) is not None}
        bar = memory.config.min_similarity()
        if memory.config.recovery_bar:
            sinks = memory.config.sink_count
            resident = [c for c in chunks if c.resident and not c.is_sink(sinks)]
            bar = max([bar, *(s for c in resident if (s := similarity(c)) is not None)])
        memory.bring_back(sims, bar, eligible, unit, incoming_locked)

    def after_message(self, message: list[Chunk], queries: torch.Tensor) -> None:
        """Recovery after the new message (``message``, resident) was prefilled, for signals that read its
        queries (``taps_message``); the others do nothing here."""

    # ---------------------------------------------------------------- scoring
    def unit(self) -> Unit:
        """How chunks group into units that come back together."""
        return exchange_units(self.memory.chunks.values()) if self.exchanges else by_message

    def similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Similarity:
        """How a chunk compares with the new message ``ids`` (embedded as ``query``), units per ``unit``."""
        raise NotImplementedError
