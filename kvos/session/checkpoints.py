"""Checkpoints of a hybrid model's recurrent state at a session's chunk boundaries.

The linear-attention layers of a hybrid model (Qwen3.5) fold every token into one fixed-size state per
sequence, which cannot be cut into chunks as K/V can. A session that truncates its history (a client
re-sent a different tail, a cancelled reply) or forks a branch needs the state as it was at that length.
The session keeps it at its last chunk boundaries; a cut between two checkpoints moves back to the one
before and the prompt's sync prefills the tokens after it again. The empty state at length 0 is always
there, so a cut older than every checkpoint re-reads the history from its start.
"""

from __future__ import annotations

from collections.abc import Callable

from kvos.model.recurrent import RecurrentState

KEPT = 4  # checkpoints a session keeps besides the empty one (each a full recurrent state)


class RecurrentCheckpoints:
    """(history length, recurrent state after it), ascending lengths, at most ``kept`` of them."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self.entries: list[tuple[int, RecurrentState]] = []

    def held_bytes(self, live: RecurrentState | None) -> int:
        """Bytes of the recurrent states a session holds: ``live`` and these checkpoints, each layer's state
        counted once however many of them share it (two with no token between them share every one)."""
        seen: dict[int, int] = {}
        for state in [live] if live is not None else []:
            seen.update((id(d), d.nbytes) for d in state.layers.values())
        for _, state in self.entries:
            seen.update((id(d), d.nbytes) for d in state.layers.values())
        return sum(seen.values())

    def take(self, length: int, state: RecurrentState) -> None:
        """Remember ``state`` as the state after ``length`` tokens of history (replacing any at or past
        ``length``: the history was cut and grew again)."""
        self.drop_after(length - 1)
        if self.kept:
            self.entries.append((length, state.copy()))
            del self.entries[: -self.kept]

    def at_or_before(self, length: int, live: RecurrentState | None = None) -> tuple[int, RecurrentState]:
        """The latest state at or before ``length`` tokens: ``live`` (the session's own, after its
        ``tokens``) where it is not past ``length``, else a checkpoint's, else the empty state at 0; as (its
        length, a copy of it)."""
        if live is not None and live.tokens <= length:
            return live.tokens, live.copy()
        for at, state in reversed(self.entries):
            if at <= length:
                return at, state.copy()
        return 0, RecurrentState()

    def settle(
        self, length: int, cut: Callable[[int], int], live: RecurrentState | None = None
    ) -> tuple[int, RecurrentState]:
        """Where a cut of the history at or before ``length`` tokens can stand with a known state: the
        latest state (:meth:`at_or_before`) at which ``cut`` (the length a cut there really keeps: a chunk
        that is not resident goes whole) keeps exactly that many tokens. Length 0 always can."""
        at, state = self.at_or_before(length, live)
        while (kept := cut(at)) != at:
            at, state = self.at_or_before(kept, live)
        return at, state

    def drop_after(self, length: int) -> None:
        """Forget the checkpoints past ``length`` tokens (the history no longer reaches them)."""
        self.entries = [(at, s) for at, s in self.entries if at <= length]

    def copy_until(self, length: int) -> RecurrentCheckpoints:
        """A branch's own checkpoints: these, up to ``length`` tokens."""
        out = RecurrentCheckpoints(self.kept)
        out.entries = [(at, s.copy()) for at, s in self.entries if at <= length]
        return out
