"""One session's memory policy in action: the executor of its plans, and its recoveries.

Holds the policy state of a session besides its :class:`History` (task focus, attention tracker, journal).
What to page out is decided by the pure functions of :mod:`kvos.policy.planner` on a :class:`Residency` of
the session; this class takes the residency views, carries the plans out through the session's :class:`Pager`
and logs them. Which chunks deserve to come back is the session's recovery signal's to say
(:mod:`kvos.session.recovery`); this class brings them back (:meth:`SessionMemory.bring_back`). Pool
capacity is asked for before an operation takes blocks (:meth:`reserve`), never discovered by catching a
failed allocation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvos.errors import BudgetError
from kvos.policy.attention import AttentionTracker
from kvos.policy.chunks import Chunk, ChunkState
from kvos.policy.digest import KeyDigest, attention_shares, head_mask
from kvos.policy.focus import TaskFocus
from kvos.policy.lexical import ChunkLexicon, overlap
from kvos.policy.planner import Eviction, Residency, affordable, plan_room
from kvos.policy.scorer import ScoreContext
from kvos.session.arbiter import PoolArbiter
from kvos.session.config import SessionConfig
from kvos.session.embedder import Embedder
from kvos.session.history import History
from kvos.session.journal import Journal, TurnCosts
from kvos.session.pager import Pager
from kvos.session.units import Unit, seam_units, unit_groups


class SessionMemory:
    """Keeps one session within its budget and brings its chunks back."""

    def __init__(
        self,
        session_id: str,
        config: SessionConfig,
        history: History,
        pager: Pager,
        arbiter: PoolArbiter | None = None,
        embed: Embedder | None = None,
    ) -> None:
        """``arbiter``: who makes room in the shared pool at its cap (default: one of the session's own,
        which pages out only this session's chunks). ``embed``: embeds a chunk's tokens when its embedding
        is first needed (:meth:`embedding_of`)."""
        self.session_id, self.config, self.history, self.pager = session_id, config, history, pager
        self.arbiter = arbiter if arbiter is not None else PoolArbiter(pager.engine.pool)
        self.embed = embed
        self.chunks: dict[int, Chunk] = history.chunks
        self.tracker = AttentionTracker(mode=config.attention_mode)  # type: ignore[arg-type]
        self.focus = TaskFocus()
        self.journal = Journal()
        self.costs = TurnCosts()
        self.lexicon = ChunkLexicon()  # the lexical signal's IDF over self.chunks, kept up to date

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

    def residency(self) -> Residency:
        """The session as the planner sees it now (scores computed now)."""
        resident, scores = self.resident_scores()
        return Residency(
            tuple(resident),
            scores,
            self.pager.active_tokens,
            self.config.budget,
            self.config.sink_count,
            frozenset(self.history.protected),
            seam_units(self.chunks.values()),
        )

    def make_room(self, n: int, protected: set[int] | None = None) -> None:
        """Page out chunks so that ``n`` more tokens keep the session within its budget
        (:func:`~kvos.policy.planner.plan_room`; ``protected``: the chunks held by the caller).

        Raises :class:`BudgetError` when even that leaves no room (what is resident is pinned, sinks or
        held), after carrying out the evictions the plan could make."""
        if not self.config.budget.over(self.pager.active_tokens + n):
            return
        plan = plan_room(self.residency(), n, frozenset(protected or ()))
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
        self.log_drops()
        return freed

    def page_out(self, chunks: list[Chunk]) -> int:
        """Page these resident chunks out now, whatever the policy would choose (logged with score 0)."""
        return self.carry_out([Eviction(c.chunk_id, c.num_tokens, 0.0) for c in chunks])

    def reserve(self, blocks: Callable[[], int], holding: set[int]) -> bool:
        """Make sure the pool can allocate ``blocks()`` more blocks, never paging out ``holding`` chunks:
        the arbiter's decision (:meth:`PoolArbiter.reserve`). False when the pool still cannot."""
        return self.arbiter.reserve(self, blocks, holding)

    def log(self, event: str, **detail: Any) -> None:
        """Journal an event of this session at its current turn."""
        self.journal.log(self.history.turn, event, **detail)

    def hold(self, tokens: int, holding: set[int], into: Chunk | None = None) -> None:
        """:meth:`reserve` the blocks of writing ``tokens`` tokens (into ``into``'s segment, or a new one);
        :class:`PoolOutOfMemoryError` when the pool's cap leaves no room for them."""
        if not self.reserve(lambda: self.pager.blocks_for(tokens, into), holding):
            raise self.pager.engine.pool.out_of_memory(self.pager.blocks_for(tokens, into))

    # ---------------------------------------------------------------- recovery
    def bring_back(
        self,
        sims: dict[int, float],
        bar: float,
        eligible: Callable[[Chunk], bool],
        unit: Unit,
        incoming_locked: int = 0,
        before: list[int] | None = None,
    ) -> None:
        """Recover the best units (per ``unit``, of the ``eligible`` chunks) of the chunks whose score in
        ``sims`` (chunk id -> score) is above ``bar``, as many as :meth:`_affordable` lets come back: the
        best last, at the end of the cache or in front of the first chunk of ``before`` still resident. A
        chosen unit's resident chunks are protected for the turn."""
        ranked = sorted((i for i, s in sims.items() if s > bar), key=lambda i: sims[i], reverse=True)
        groups = unit_groups(self.chunks, ranked, eligible, unit)  # with an exchange, its resident chunks
        for best, group in reversed(self._affordable(groups, incoming_locked)):
            for chunk_id in group:  # a unit's chunks in their order, the best unit last
                chunk = self.chunks[chunk_id]
                if chunk.resident:  # part of a chosen exchange: kept for the turn
                    self.history.protected.add(chunk_id)
                elif not self.recover(chunk, similarity=round(sims[best], 4), matched=best, before=before):
                    return

    def attention_shares(
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
            if c.chunk_id in exclude or not self.eligible(c):
                continue
            if c.resident:
                digests[c.chunk_id] = self.pager.digest(c)
            elif c.digest is not None:
                digests[c.chunk_id] = c.digest
        return digests

    def eligible(self, chunk: Chunk) -> bool:
        """A candidate of a signal whose units are exchanges: recoverable, or resident and holdable."""
        return self.recoverable(chunk) or self._holdable(chunk)

    def _holdable(self, chunk: Chunk) -> bool:
        """Resident and free to page out: neither a sink, nor pinned, nor protected this turn."""
        return (
            chunk.resident
            and not chunk.is_sink(self.config.sink_count)
            and not chunk.pinned
            and chunk.chunk_id not in self.history.protected
        )

    def lexical_weights(self, ids: list[int]) -> dict[int, float]:
        """The new message ``ids``'s token weights for the lexical score (:func:`overlap` with a chunk's
        distinct tokens, :meth:`ChunkLexicon.tokens`), from the IDF over every chunk of the session."""
        return self.lexicon.sync(self.chunks).weights(ids)

    def learned_candidates(self, ids: list[int]) -> tuple[list[Chunk], list[torch.Tensor], list[float]]:
        """What the "learned" signal reads of the session for the new message ``ids``: the candidate
        chunks (recoverable, or resident and holdable, with K/V to score: a discarded chunk has none), each
        one's key code (:meth:`Pager.key_codes`) and lexical score. ``kvos calibrate --retriever`` reads
        the same with an identity retriever (codes that are the raw keys)."""
        chunks = [c for c in self.chunks.values() if self.eligible(c) and c.token_ids] if ids else []
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

    def _affordable(
        self, groups: list[tuple[int, list[int]]], incoming_locked: int = 0
    ) -> list[tuple[int, list[int]]]:
        """The groups :func:`~kvos.policy.planner.affordable` lets come back this turn: their tokens fit
        with the pinned chunks, sinks and this turn's protected chunks, the new message's locked tokens
        and one chunk being written."""
        locked = self.history.locked_tokens(self.config.sink_count, with_protected=True)
        room = self.config.budget.max_active_tokens - self.config.chunk_tokens - locked - incoming_locked
        return affordable(groups, self.chunks, room, self.config.recovery_top_k)

    def recoverable(self, chunk: Chunk) -> bool:
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
        self.log_drops()
        return True

    def _front(self, before: list[int] | None) -> int | None:
        """The first chunk of ``before`` still resident (paging may have taken the others), or None."""
        return next((i for i in before or () if i in self.pager.segments), None)

    def fill_headroom(self, prompt: list[int]) -> int:
        """Identity gap-fill within headroom: saved chunks whose exact tokens the re-sent ``prompt`` holds at
        their original place come back there, most recent first, while the session stays under its low
        watermark (re-sending a whole conversation brings back what fits, not more). Returns how many came
        back; stops at the first the pool cannot hold."""
        target = self.config.budget.target()
        restored = 0
        for chunk in sorted(self.chunks.values(), key=lambda c: c.original_start, reverse=True):
            fits = self.pager.active_tokens + chunk.num_tokens <= target
            resent = prompt[chunk.original_start : chunk.original_end] == chunk.token_ids
            if not (chunk.state is ChunkState.SAVED and fits and resent):
                continue
            if not self.recover(chunk, at="place", trigger="gap_fill"):
                break
            restored += 1
        return restored

    def log_drops(self) -> None:
        """Log the saved chunks whose K/V the store dropped (over its caps, or a corrupt file): they keep
        their breadcrumb (text, tokens, embedding) and are recomputed if they come back."""
        for chunk_id in self.pager.take_dropped():
            self.journal.log(self.history.turn, "drop", chunk=chunk_id)

    def observe(self, captured: dict[int, torch.Tensor]) -> None:
        """Per-chunk attention mass of this decode step, averaged over the captured layers and heads
        (every layer has as many heads, so the mean over the layers' rows stacked together is the mean of
        the layers' means: one pass, where a pass per layer cost 0.1 ms a token each)."""
        if not captured:
            return
        self.tracker.observe_probs(list(captured.values()), self.pager.seq.boundaries(), self.pager.order())
