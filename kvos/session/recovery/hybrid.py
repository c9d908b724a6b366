"""The "hybrid" signal: the answer signal asked only about a shortlist (by attention and words, or by a
calibrated retriever)."""

from __future__ import annotations

from kvos.policy.lexical import overlap
from kvos.session.queries import QueryTap
from kvos.session.recovery.answer import Answer, Candidates
from kvos.session.recovery.learned import learned_scores
from kvos.session.units import Unit, unit_texts


class Hybrid(Answer):
    """The null answer's scratch pass (the sinks, the new message, the generation prompt, the answer) taps
    its queries; the ``recovery_shortlist`` units they would attend to most (by key digests) and as many
    lexically closest form a shortlist, and only those are scored by the answer signal."""

    name = "hybrid"
    digests = True

    def choose(
        self, ids: list[int], prefix: list[int], query: list[int], unit: Unit, candidates: Candidates
    ) -> dict[int, float]:
        assert self.answer is not None
        memory = self.memory
        tap = QueryTap(memory.pager.digest_layers, memory.pager.engine.model.ropes)
        answer = self.answer.null_answer(self.answer.base(prefix, query), tap)
        shares = memory.attention_shares(tap.take(memory.config.query_window))
        shortlist = self.shortlist(query, shares, unit, set(candidates))
        chosen = {u: candidates[u] for u in sorted(shortlist)}
        return self.answer.scores(prefix, query, chosen, answer=answer)

    def shortlist(self, ids: list[int], shares: dict[int, float], unit: Unit, units: set[int]) -> set[int]:
        """The ``units`` asked about: the ``recovery_shortlist`` best by their chunks' attention ``shares``
        and as many best by lexical overlap with the new message ``ids``."""
        memory = self.memory
        by_attention: dict[int, float] = dict.fromkeys(units, 0.0)
        for chunk_id, share in shares.items():
            key = unit(memory.chunks[chunk_id])
            if key in units:
                by_attention[key] = max(by_attention[key], share)
        weights = memory.lexical_weights(ids)
        texts = unit_texts(memory.chunks.values(), unit)
        by_words = {key: overlap(weights, frozenset(texts[key])) for key in units}
        m = memory.config.recovery_shortlist
        best = (sorted(s, key=lambda k: (s[k], k), reverse=True)[:m] for s in (by_attention, by_words))
        return set().union(*best)


class LearnedHybrid(Answer):
    """The "hybrid" signal of a session with a retriever: the ``recovery_shortlist`` units the learned signal
    scores best (no forward pass) are scored by the answer signal (their passes packed)."""

    name = "hybrid"
    needs_retriever = True

    def choose(
        self, ids: list[int], prefix: list[int], query: list[int], unit: Unit, candidates: Candidates
    ) -> dict[int, float]:
        assert self.answer is not None
        best: dict[int, float] = {}
        for chunk_id, score in learned_scores(self.memory, ids).items():
            key = unit(self.memory.chunks[chunk_id])
            if key in candidates:
                best[key] = max(best.get(key, float("-inf")), score)
        m = self.memory.config.recovery_shortlist
        shortlist = sorted(best, key=lambda k: (best[k], k), reverse=True)[:m]
        return self.answer.scores(prefix, query, {u: candidates[u] for u in sorted(shortlist)})
