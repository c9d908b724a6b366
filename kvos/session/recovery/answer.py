"""The "answer" signal: how much a unit of the session changes the model's answer to the new message."""

from __future__ import annotations

import torch

from kvos.policy.lexical import overlap
from kvos.session.recovery.base import RecoverySignal, Similarity
from kvos.session.recovery.lexical import lexical_similarity
from kvos.session.units import Unit, bounded, exchange_units, in_order, unit_texts

Candidates = dict[int, list[int]]
"""unit -> its tokens: what the answer signal may ask the model about."""


class Answer(RecoverySignal):
    """A unit (an exchange, or a part of a longer one) scores the :class:`AnswerContrast` of its text against
    the new message: one short scratch forward pass per candidate, at most ``recovery_candidates`` of them
    (the lexically closest, then the most recent). Lexical for a turn whose scratch passes the pool cannot
    hold. 0.3 nats by default."""

    name = "answer"
    bar = 0.3
    exchanges = True
    scratch = True

    def unit(self) -> Unit:
        """Exchanges, a long one cut into parts of at most :meth:`span` tokens (a pass per part)."""
        chunks = self.memory.chunks.values()
        return bounded(exchange_units(chunks), chunks, self.span())

    def similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Similarity:
        scores = self._scores(ids, unit)
        if scores is None:
            return lexical_similarity(self, ids)
        return lambda c: scores.get(unit(c))

    def span(self) -> int:
        """The most tokens the signal reads of one candidate, and of the new message: the budget (a larger
        unit cannot come back whole) and at most 4 chunks, so a turn's scoring stays bounded (at most
        ``recovery_candidates`` passes of at most three such spans) whatever the messages' size."""
        config = self.memory.config
        return min(config.budget.max_active_tokens, 4 * config.chunk_tokens)

    def _scores(self, ids: list[int], unit: Unit) -> dict[int, float] | None:
        """unit -> score of its whole text against the new message's last :meth:`span` tokens, for the units
        with a recoverable or holdable chunk (chosen by :meth:`choose`), or None when the pool cannot hold
        the scratch passes."""
        assert self.answer is not None
        memory = self.memory
        texts = unit_texts(memory.chunks.values(), unit)
        wanted = {unit(c) for c in memory.chunks.values() if memory.eligible(c)}
        candidates = {u: texts[u] for u in sorted(wanted)}
        prefix = self.sink_tokens()
        query = ids[-self.span() :]  # a pasted file: its end, where the question is
        scratch = self.answer.scratch_tokens(prefix, query, candidates.values())
        pool = memory.pager.engine.pool
        if not pool.can_allocate(-(-scratch // pool.layout.block_size)):
            memory.journal.log(memory.history.turn, "answer_signal_skipped", reason="pool_full")
            return None
        return self.choose(ids, prefix, query, unit, candidates)

    def choose(
        self, ids: list[int], prefix: list[int], query: list[int], unit: Unit, candidates: Candidates
    ) -> dict[int, float]:
        """Score the ``candidates`` (unit -> its tokens) worth a pass: the ``recovery_candidates`` lexically
        closest to the new message ``ids``, with the sinks ``prefix`` before each and the message's ``query``
        tokens after. unit -> nats."""
        assert self.answer is not None
        cap = self.memory.config.recovery_candidates
        if len(candidates) > cap:
            weights = self.memory.lexical_weights(ids)
            lexical = {u: overlap(weights, frozenset(tokens)) for u, tokens in candidates.items()}
            kept = sorted(candidates, key=lambda u: (lexical[u], u), reverse=True)[:cap]
            candidates = {u: candidates[u] for u in kept}
        return self.answer.scores(prefix, query, candidates)

    def sink_tokens(self) -> list[int]:
        """The tokens of the session's resident sink chunks, in order: what every scratch pass starts with."""
        sinks = self.memory.config.sink_count
        chunks = in_order(self.memory.chunks.values())
        return [t for c in chunks if c.resident and c.is_sink(sinks) for t in c.token_ids]
