"""One session's memory policy in action: the executor of its plans, and its recoveries.

Holds the policy state of a session besides its :class:`History` (task focus, attention tracker, journal).
What to page out is decided by the pure functions of :mod:`kvos.policy.planner` on a :class:`Snapshot` of
the session; this class takes the snapshots, carries the plans out through the session's :class:`Pager`
and logs them. Pool capacity is asked for before an operation takes blocks (:meth:`reserve`), never
discovered by catching a failed allocation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvos.errors import BudgetError
from kvos.policy.attention import AttentionTracker, chunk_masses
from kvos.policy.chunks import Chunk, ChunkState
from kvos.policy.digest import KeyDigest, attention_shares, head_mask
from kvos.policy.focus import TaskFocus
from kvos.policy.lexical import ChunkLexicon, overlap
from kvos.policy.planner import Eviction, Snapshot, affordable, plan_room, pressure_victim
from kvos.policy.retriever import Retriever
from kvos.policy.scorer import ScoreContext
from kvos.policy.signals import cosine
from kvos.session.config import SessionConfig
from kvos.session.embedder import Embedder
from kvos.session.history import History
from kvos.session.journal import Journal, TurnCosts
from kvos.session.pager import Pager
from kvos.session.queries import QueryTap
from kvos.session.relevance import AnswerContrast
from kvos.session.units import (
    Unit,
    bounded,
    by_message,
    exchange_units,
    in_order,
    unit_groups,
    unit_texts,
)


class SessionMemory:
    """Keeps one session within its budget and brings its chunks back."""

    def __init__(
        self,
        session_id: str,
        config: SessionConfig,
        history: History,
        pager: Pager,
        relieve: Callable[[SessionMemory], bool] | None = None,
        answer: AnswerContrast | None = None,
        embed: Embedder | None = None,
    ) -> None:
        """``answer``: the scorer of the "answer" recovery signal (without one, that signal is lexical).
        ``embed``: embeds a chunk's tokens when its embedding is first needed (:meth:`embedding_of`)."""
        self.session_id, self.config, self.history, self.pager = session_id, config, history, pager
        self.relieve, self.answer, self.embed = relieve, answer, embed
        self.chunks: dict[int, Chunk] = history.chunks
        self.tracker = AttentionTracker(mode=config.attention_mode)  # type: ignore[arg-type]
        self.focus = TaskFocus()
        self.journal = Journal()
        self.costs = TurnCosts()
        self.lexicon = ChunkLexicon()  # the lexical signal's IDF over self.chunks, kept up to date
        # called with the message's chunks and its tapped queries before the "attention" signal scores
        # (kvos calibrate --retrieval watches the probe turns)
        self.queries_observer: Callable[[list[Chunk], torch.Tensor], None] | None = None
        # called with a new user message's token ids before similarity recovery (kvos calibrate --retriever)
        self.recovery_observer: Callable[[list[int]], None] | None = None

    # ------------------------------------------------------------------ budget
    def score_context(self) -> ScoreContext:
        return ScoreContext(
            turn=self.history.turn,
            total_tokens=self.history.tokens,
            focus=self.focus.vector,
            attention=self.tracker,
        )

    def embedding_of(self, chunk: Chunk) -> torch.Tensor | None:
        """The chunk's embedding, computed from its tokens the first time it is needed (a chunk's
        embedding is context-free, so when it is computed does not change it): a session that never
        scores its chunks never runs the embedder on them."""
        if chunk.embedding is None and self.embed is not None and chunk.token_ids:
            chunk.embedding = self.embed(chunk.token_ids)
        return chunk.embedding

    def resident_scores(self) -> tuple[list[Chunk], dict[int, float]]:
        """The resident chunks in cache order and their scores (embedding them first where coherence
        counts)."""
        resident = [self.chunks[i] for i in self.pager.order() if i in self.chunks]
        context = self.score_context()
        if context.focus is not None and self.config.scorer.weights.coherence > 0.0:
            for chunk in resident:
                self.embedding_of(chunk)
        return resident, self.config.scorer.scores(resident, context)

    def snapshot(self) -> Snapshot:
        """The session as the planner sees it now (scores computed now)."""
        resident, scores = self.resident_scores()
        return Snapshot(
            tuple(resident),
            scores,
            self.pager.active_tokens,
            self.config.budget,
            self.config.sink_count,
            frozenset(self.history.protected),
        )

    def make_room(self, n: int, protected: set[int] | None = None) -> None:
        """Page out chunks so that ``n`` more tokens keep the session within its budget
        (:func:`~kvos.policy.planner.plan_room`; ``protected``: the chunks held by the caller).

        Raises :class:`BudgetError` when even that leaves no room (what is resident is pinned, sinks or
        held), after carrying out the evictions the plan could make."""
        if not self.config.budget.over(self.pager.active_tokens + n):
            return
        plan = plan_room(self.snapshot(), n, frozenset(protected or ()))
        self.carry_out(plan.evictions)
        if not plan.fits:
            raise BudgetError(
                f"session {self.session_id}: {n} more tokens do not fit in max_active_tokens="
                f"{self.config.budget.max_active_tokens}: the {self.pager.active_tokens} resident tokens are "
                "pinned, sinks or protected"
            )

    def carry_out(self, evictions: tuple[Eviction, ...] | list[Eviction]) -> int:
        """Page out the planned ``evictions`` (each logged); returns the pool blocks freed."""
        if not evictions:
            return 0
        freed = self.pager.evict([self.chunks[e.chunk_id] for e in evictions])
        for e in evictions:
            self.tracker.forget(e.chunk_id)
            score = round(e.score, 4)
            self.journal.log(
                self.history.turn, "evict", chunk=e.chunk_id, tokens=e.tokens, score=score, forced=e.forced
            )
        return freed

    def page_out(self, chunks: list[Chunk]) -> int:
        """Page these resident chunks out now, whatever the policy would choose (logged with score 0)."""
        return self.carry_out([Eviction(c.chunk_id, c.num_tokens, 0.0) for c in chunks])

    def reserve(self, blocks: Callable[[], int], holding: set[int]) -> bool:
        """Make sure the pool can allocate ``blocks()`` more blocks (asked again after each eviction: what
        an operation needs may change as the cache does). At the pool's cap, the lowest-scored chunk of
        another idle session goes first (through the manager), then this session's own
        (:func:`~kvos.policy.planner.pressure_victim`), one at a time, never ``holding`` ones. False when
        nothing more may go and the pool still cannot hold them."""
        pool = self.pager.engine.pool
        while not pool.can_allocate(blocks()):
            if self.relieve is not None and self.relieve(self):
                continue
            victim = pressure_victim(self.snapshot(), frozenset(holding))
            if victim is None:
                return False
            self.carry_out([victim])
            self.journal.log(self.history.turn, "pool_full", chunk=victim.chunk_id)
        return True

    def hold(self, tokens: int, holding: set[int], into: Chunk | None = None) -> None:
        """:meth:`reserve` the blocks of writing ``tokens`` tokens (into ``into``'s segment, or a new one);
        :class:`PoolOutOfMemoryError` when the pool's cap leaves no room for them."""
        if not self.reserve(lambda: self.pager.blocks_for(tokens, into), holding):
            raise self.pager.engine.pool.out_of_memory(self.pager.blocks_for(tokens, into))

    # ---------------------------------------------------------------- recovery
    def recover_similar(self, ids: list[int], query: torch.Tensor, incoming_locked: int = 0) -> None:
        """Bring back the saved (or breadcrumbed) chunks most similar to the new user message ``ids``
        (embedded as ``query``), best last. ``incoming_locked``: tokens of the new message that will stay
        locked (a pinned message), so the recovered chunks leave room for them.

        With the "answer" signal the unit is an exchange (:func:`~kvos.session.units.exchange_units`),
        not a message (a message's chunks come back together either way), resident exchanges compete
        too, and a chosen exchange's resident chunks are protected for the turn, so making room for the
        new message cannot page out what its answer needs (nor half of an exchange brought back)."""
        if self.recovery_observer is not None:
            self.recovery_observer(ids)
        if self.config.backend == "discard" or self.config.recovery_top_k == 0:
            return
        if not any(self._recoverable(c) for c in self.chunks.values()):
            return
        signal = self.config.signal
        exchanges = signal in ("answer", "hybrid", "learned")
        eligible = self._eligible if exchanges else self._recoverable
        unit = exchange_units(self.chunks.values()) if exchanges else by_message
        if signal in ("answer", "hybrid"):  # a forward pass over each candidate: long messages go in parts
            unit = bounded(unit, self.chunks.values(), self._answer_span())
        candidates = [c for c in self.chunks.values() if eligible(c)]
        similarity = self._similarity(ids, query, unit)
        sims = {c.chunk_id: s for c in candidates if (s := similarity(c)) is not None}
        bar = self.config.min_similarity()
        if self.config.recovery_bar:
            sinks = self.config.sink_count
            resident = [c for c in self.chunks.values() if c.resident and not c.is_sink(sinks)]
            bar = max([bar, *(s for c in resident if (s := similarity(c)) is not None)])
        self._bring_back(sims, bar, eligible, unit, incoming_locked)

    def _bring_back(
        self,
        sims: dict[int, float],
        bar: float,
        eligible: Callable[[Chunk], bool],
        unit: Unit,
        incoming_locked: int = 0,
        before: list[int] | None = None,
    ) -> None:
        """Recover the best units of the chunks scoring above ``bar`` (see :meth:`recover_similar`): the
        best last, at the end of the cache or in front of the first chunk of ``before`` still resident."""
        ranked = sorted((i for i, s in sims.items() if s > bar), key=lambda i: sims[i], reverse=True)
        groups = unit_groups(self.chunks, ranked, eligible, unit)  # with an exchange, its resident chunks
        for best, group in reversed(self._affordable(groups, incoming_locked)):
            for chunk_id in group:  # a unit's chunks in their order, the best unit last
                chunk = self.chunks[chunk_id]
                if chunk.resident:  # part of a chosen exchange: kept for the turn
                    self.history.protected.add(chunk_id)
                elif not self.recover(chunk, similarity=round(sims[best], 4), matched=best, before=before):
                    return

    def recover_attending(self, message: list[Chunk], queries: torch.Tensor) -> None:
        """The "attention" signal, after the new user message (``message``, resident) was prefilled: bring
        back the exchanges its queries would attend to most, by their chunks' key digests (saved chunks keep
        theirs; resident ones are read from the pool), each spliced in front of the message (whose keys then
        move up: it was computed without them, the reply that follows sees both).

        queries: float32 ``[layers, n, heads, head_dim]`` of the message's last tokens at
        ``pager.digest_layers``, rotated back to position 0."""
        if self.config.backend == "discard" or self.config.recovery_top_k == 0 or not message:
            return
        if self.queries_observer is not None:
            self.queries_observer(message, queries)
        mine = {c.chunk_id for c in message}
        self.history.protected |= mine
        if not any(self._recoverable(c) and c.digest is not None for c in self.chunks.values()):
            return
        sims = self._attention_shares(queries, exclude=mine)
        bar = self.config.min_similarity()
        unit = exchange_units(self.chunks.values())
        self._bring_back(sims, bar, self._eligible, unit, before=[c.chunk_id for c in message])

    def _attention_shares(
        self, queries: torch.Tensor, exclude: frozenset[int] | set[int] = frozenset()
    ) -> dict[int, float]:
        """Chunk id -> :func:`~kvos.policy.digest.attention_shares` of ``queries`` (float32 ``[layers, n,
        heads, head_dim]``, rotated back to position 0) over the :meth:`candidate_digests` but ``exclude``,
        averaged over the ``retrieval_heads`` (or every head)."""
        digests = self.candidate_digests(exclude)
        if not digests:
            return {}
        lo = torch.stack([d.lo for d in digests.values()])
        hi = torch.stack([d.hi for d in digests.values()])
        retrieval = self.config.retrieval_heads
        heads = None
        if retrieval is not None:
            heads = head_mask(retrieval, self.pager.digest_layers, self.pager.engine.model.config.num_heads)
        return dict(zip(digests, attention_shares(queries, lo, hi, heads).tolist(), strict=True))

    def candidate_digests(self, exclude: frozenset[int] | set[int] = frozenset()) -> dict[int, KeyDigest]:
        """Chunk id -> key digest of the attention signal's candidates: recoverable chunks with a digest
        and holdable resident ones (their digest read from the pool), but ``exclude``."""
        digests: dict[int, KeyDigest] = {}
        for c in self.chunks.values():
            if c.chunk_id in exclude or not self._eligible(c):
                continue
            if c.resident:
                digests[c.chunk_id] = self.pager.digest(c)
            elif c.digest is not None:
                digests[c.chunk_id] = c.digest
        return digests

    def _eligible(self, chunk: Chunk) -> bool:
        """A candidate of the answer signal: recoverable, or resident and holdable."""
        return self._recoverable(chunk) or self._holdable(chunk)

    def _holdable(self, chunk: Chunk) -> bool:
        """Resident and free to page out: neither a sink, nor pinned, nor protected this turn."""
        return (
            chunk.resident
            and not chunk.is_sink(self.config.sink_count)
            and not chunk.pinned
            and chunk.chunk_id not in self.history.protected
        )

    def _similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Callable[[Chunk], float | None]:
        """How a chunk is compared with the new message: by the model's answer ("answer", per ``unit``;
        lexical for this turn if the pool has no room for its scratch passes), IDF-weighted token overlap
        over the session's chunks ("lexical") or the cosine of the embeddings ("embedding"; None without an
        embedding). None: not a candidate."""
        signal = self.config.signal
        if signal == "learned":
            learned = self._learned_scores(ids)
            return lambda c: learned.get(c.chunk_id)
        if signal in ("answer", "hybrid") and self.answer is not None:
            scores = self._answer_scores(ids, unit)
            if scores is not None:
                return lambda c: scores.get(unit(c))
            signal = "lexical"
        if signal in ("lexical", "answer", "hybrid"):
            weights = self.lexical_weights(ids)
            return lambda c: overlap(weights, self.lexicon.tokens(c))

        def similarity(chunk: Chunk) -> float | None:
            embedding = self.embedding_of(chunk)
            return None if embedding is None else cosine(query, embedding)

        return similarity

    def lexical_weights(self, ids: list[int]) -> dict[int, float]:
        """The new message ``ids``'s token weights for the lexical score (:func:`overlap` with a chunk's
        distinct tokens, :meth:`ChunkLexicon.tokens`), from the IDF over every chunk of the session."""
        return self.lexicon.sync(self.chunks).weights(ids)

    def _learned_scores(self, ids: list[int]) -> dict[int, float]:
        """The "learned" signal: chunk id -> :class:`~kvos.policy.retriever.Retriever` score of every
        candidate chunk (:meth:`learned_candidates`) for the new message ``ids``: its last
        ``query_window`` tokens' projected layer-0 queries come from the retriever's per-token table."""
        retriever = self.config.retriever
        assert retriever is not None
        with torch.no_grad():
            return self._learned_scores_of(retriever, ids)

    def _learned_scores_of(self, retriever: Retriever, ids: list[int]) -> dict[int, float]:
        chunks, codes, lexical = self.learned_candidates(ids)
        if not chunks:
            return {}
        queries = retriever.token_queries(self.pager.engine.model, ids[-self.config.query_window :])
        scores = retriever.combine(retriever.scores(queries, codes), torch.tensor(lexical))
        return dict(zip((c.chunk_id for c in chunks), scores.tolist(), strict=True))

    def learned_candidates(self, ids: list[int]) -> tuple[list[Chunk], list[torch.Tensor], list[float]]:
        """What the "learned" signal reads of the session for the new message ``ids``: the candidate
        chunks (recoverable, or resident and holdable, with K/V to score: a discarded chunk has none), each
        one's key code (:meth:`Pager.key_codes`) and lexical score. ``kvos calibrate --retriever`` reads
        the same with an identity retriever (codes that are the raw keys)."""
        chunks = [c for c in self.chunks.values() if self._eligible(c) and c.token_ids] if ids else []
        if not chunks:
            return [], [], []
        coded = [
            (c, code)
            for c, code in zip(chunks, self.pager.key_codes(chunks), strict=True)
            if code is not None
        ]
        weights = self.lexical_weights(ids)
        kept = [c for c, _ in coded]
        return kept, [code for _, code in coded], [overlap(weights, self.lexicon.tokens(c)) for c in kept]

    def _answer_scores(self, ids: list[int], unit: Unit) -> dict[int, float] | None:
        """unit (an exchange, :func:`~kvos.session.units.exchange_units`, or a chunk of a longer one: see
        :func:`~kvos.session.units.bounded`) -> :class:`AnswerContrast` score of its whole text against the
        new message's last :meth:`_answer_span` tokens, for the units with a recoverable or holdable chunk,
        at most ``recovery_candidates`` of them (the lexically closest, then the most recent; with the
        "hybrid" signal a shortlist: :meth:`_hybrid_scores`), or None when the pool cannot hold the scratch
        passes."""
        assert self.answer is not None
        texts = unit_texts(self.chunks.values(), unit)
        wanted = {unit(c) for c in self.chunks.values() if self._eligible(c)}
        candidates = {u: texts[u] for u in sorted(wanted)}
        cap = self.config.recovery_candidates
        prefix = self._sink_tokens()
        query = ids[-self._answer_span() :]  # a pasted file: its end, where the question is
        scratch = self.answer.scratch_tokens(prefix, query, candidates.values())
        if not self.pager.engine.pool.can_allocate(-(-scratch // self.pager.engine.pool.layout.block_size)):
            self.journal.log(self.history.turn, "answer_signal_skipped", reason="pool_full")
            return None
        if self.config.signal == "hybrid" and self.config.retriever is not None:
            return self._learned_shortlist_scores(ids, prefix, query, unit, candidates)
        if self.config.signal == "hybrid":
            return self._hybrid_scores(prefix, query, unit, candidates)
        if len(candidates) > cap:
            weights = self.lexical_weights(ids)
            lexical = {u: overlap(weights, frozenset(tokens)) for u, tokens in candidates.items()}
            kept = sorted(candidates, key=lambda u: (lexical[u], u), reverse=True)[:cap]
            candidates = {u: candidates[u] for u in kept}
        return self.answer.scores(prefix, query, candidates)

    def _hybrid_scores(
        self, prefix: list[int], query: list[int], unit: Unit, candidates: dict[int, list[int]]
    ) -> dict[int, float]:
        """The "hybrid" signal: the null answer's scratch pass (the sinks ``prefix``, the new message's
        ``query`` tokens, the generation prompt, the answer) taps its queries; the units its queries would
        attend to most (by key digests) and the lexically closest form a shortlist, and only those are
        scored by the answer signal (one forward pass each). unit -> nats."""
        assert self.answer is not None
        tap = QueryTap(self.pager.digest_layers, self.pager.engine.model.rope)
        answer = self.answer.null_answer(self.answer.base(prefix, query), tap)
        sims = self._attention_shares(tap.take(self.config.query_window))
        shortlist = self._shortlist(query, sims, unit, set(candidates))
        chosen = {u: candidates[u] for u in sorted(shortlist)}
        return self.answer.scores(prefix, query, chosen, answer=answer)

    def _learned_shortlist_scores(
        self,
        ids: list[int],
        prefix: list[int],
        query: list[int],
        unit: Unit,
        candidates: dict[int, list[int]],
    ) -> dict[int, float]:
        """The "hybrid" signal with a retriever: the ``recovery_shortlist`` units the learned signal scores
        best (no forward pass) are scored by the answer signal (their passes packed). unit -> nats."""
        assert self.answer is not None
        best: dict[int, float] = {}
        for chunk_id, score in self._learned_scores(ids).items():
            key = unit(self.chunks[chunk_id])
            if key in candidates:
                best[key] = max(best.get(key, float("-inf")), score)
        shortlist = sorted(best, key=lambda k: (best[k], k), reverse=True)[: self.config.recovery_shortlist]
        return self.answer.scores(prefix, query, {u: candidates[u] for u in sorted(shortlist)})

    def _sink_tokens(self) -> list[int]:
        sinks = self.config.sink_count
        return [
            t for c in in_order(self.chunks.values()) if c.resident and c.is_sink(sinks) for t in c.token_ids
        ]

    def _shortlist(self, ids: list[int], shares: dict[int, float], unit: Unit, units: set[int]) -> set[int]:
        """The ``units`` the "hybrid" signal asks the model about: the ``recovery_shortlist`` best by their
        chunks' attention ``shares`` and as many best by lexical overlap with the new message ``ids``."""
        by_attention: dict[int, float] = dict.fromkeys(units, 0.0)
        for chunk_id, share in shares.items():
            key = unit(self.chunks[chunk_id])
            if key in units:
                by_attention[key] = max(by_attention[key], share)
        weights = self.lexical_weights(ids)
        texts = unit_texts(self.chunks.values(), unit)
        by_words = {key: overlap(weights, frozenset(texts[key])) for key in units}
        m = self.config.recovery_shortlist
        best = (sorted(s, key=lambda k: (s[k], k), reverse=True)[:m] for s in (by_attention, by_words))
        return set().union(*best)

    def _answer_span(self) -> int:
        """The most tokens the answer signal reads of one candidate, and of the new message: the budget
        (a larger unit cannot come back whole) and at most 4 chunks, so a turn's scoring stays bounded
        (at most ``recovery_candidates`` passes of at most three such spans) whatever the messages' size."""
        return min(self.config.budget.max_active_tokens, 4 * self.config.chunk_tokens)

    def _affordable(
        self, groups: list[tuple[int, list[int]]], incoming_locked: int = 0
    ) -> list[tuple[int, list[int]]]:
        """The groups :func:`~kvos.policy.planner.affordable` lets come back this turn: their tokens fit
        with the pinned chunks, sinks and this turn's protected chunks, the new message's locked tokens
        and one chunk being written."""
        locked = self.history.locked_tokens(self.config.sink_count, with_protected=True)
        room = self.config.budget.max_active_tokens - self.config.chunk_tokens - locked - incoming_locked
        return affordable(groups, self.chunks, room, self.config.recovery_top_k)

    def _recoverable(self, chunk: Chunk) -> bool:
        if chunk.state is ChunkState.SAVED:
            return True
        return chunk.state is ChunkState.DISCARDED and self.config.backend != "discard"

    def recover(self, chunk: Chunk, at: str = "end", before: list[int] | None = None, **detail: Any) -> bool:
        """Page a chunk back in: splice saved K/V, or recompute from its tokens; protected for this turn.

        Best effort under pool pressure: when the pool's cap leaves no room even after paging out other
        sessions' and this session's unprotected chunks, the chunk stays out (logged) and False is returned.
        """
        began = time.perf_counter()
        try:
            return self._recover(chunk, at, before, **detail)
        finally:
            self.costs.add(restore_s=time.perf_counter() - began)

    def _recover(self, chunk: Chunk, at: str, before: list[int] | None, **detail: Any) -> bool:
        self.make_room(chunk.num_tokens, protected={chunk.chunk_id})
        saved = chunk.state is ChunkState.SAVED
        keep = set(self.history.protected)  # one recovery never pages out another
        if not self.reserve(lambda: self.pager.blocks_for(chunk.num_tokens), keep):
            self.journal.log(self.history.turn, "recover_skipped", chunk=chunk.chunk_id, reason="pool_full")
            return False
        if saved:
            self.pager.restore(chunk, at, self._front(before))  # type: ignore[arg-type]
        else:
            self.pager.recompute(chunk)
        chunk.recovered_turn = self.history.turn
        self.history.protected.add(chunk.chunk_id)
        how = "restore" if saved else "recompute"
        self.journal.log(self.history.turn, how, chunk=chunk.chunk_id, tokens=chunk.num_tokens, **detail)
        self.journal.seen(self.pager.active_tokens)
        return True

    def _front(self, before: list[int] | None) -> int | None:
        """The first chunk of ``before`` still resident (paging may have taken the others), or None."""
        return next((i for i in before or () if i in self.pager.segments), None)

    def fill_gaps(self, token_ids: list[int]) -> int:
        """Identity gap-fill: walk the history against a re-sent prompt; every saved chunk whose exact
        tokens sit at its original place is spliced back at its place. Stops at the first difference."""
        restored = 0
        for chunk in sorted(self.chunks.values(), key=lambda c: c.original_start):
            if token_ids[chunk.original_start : chunk.original_end] != chunk.token_ids:
                break
            if chunk.state is ChunkState.SAVED:
                if not self.recover(chunk, at="place", trigger="gap_fill"):
                    break
                restored += 1
        return restored

    def on_drop(self, key: object) -> None:
        """The store dropped a saved chunk (over its caps): it keeps its breadcrumb (text and embedding)."""
        chunk = self.chunks.get(int(key))  # type: ignore[call-overload]
        if chunk is not None and chunk.state is ChunkState.SAVED:
            chunk.state = ChunkState.DISCARDED
            self.journal.log(self.history.turn, "drop", chunk=chunk.chunk_id)

    def observe(self, captured: dict[int, torch.Tensor]) -> None:
        """Per-chunk attention mass of this decode step, averaged over the captured layers and heads."""
        if not captured:
            return
        bounds = self.pager.seq.boundaries()
        masses = torch.stack([chunk_masses(p, bounds) for p in captured.values()]).mean(0)
        self.tracker.observe(dict(zip(self.pager.order(), masses.tolist(), strict=True)))
