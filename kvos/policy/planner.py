"""The planner: every paging decision, taken from plain views of the sessions and returned as plain data.

A :class:`Residency` is what the policy sees of a session at one moment: its resident chunks in cache order
with their scores, its resident tokens, its budget and what is protected this turn. The functions here are
pure (no pool, no model, nothing changed): :func:`plan_room` (what goes so that ``n`` more tokens fit the
budget), :func:`pressure_victim` (what goes next when the shared pool is at its cap) and
:func:`affordable` (which recovery candidates fit this turn). The executor
(:class:`kvos.session.memory.SessionMemory` with its :class:`~kvos.session.pager.Pager`) carries the plans
out. Between sessions, on :class:`SessionView` records: :func:`cheapest_elsewhere` (another session's chunk
to page out), :func:`plan_swaps` (whole sessions to swap out before a request's comes in) and
:func:`stale_branches` (a client's branches to close); the server's registry carries those out. Within
a session's history: :func:`plan_truncate` (what a cut takes back), carried out by the session.

What a plan never evicts: sinks, pinned chunks and the chunks the caller holds (the chunk being written or
restored). Chunks recovered this turn (``Residency.protected``) go only when nothing else can.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvos.policy.budget import Budget, select_victims
from kvos.policy.chunks import Chunk


@dataclass(frozen=True)
class Residency:
    """A session as the planner sees it.

    - ``resident``: its resident chunks in cache order; ``scores``: chunk id -> score for each of them;
    - ``active_tokens``: what its budget counts (:attr:`Pager.active_tokens`: the resident chunks'
      :attr:`~kvos.policy.chunks.Chunk.cost`, their tokens unless their KV heads keep their own);
    - ``protected``: chunk ids protected for this turn (recovered ones), which yield only to the chunks a
      caller holds;
    - ``units``: chunk id -> the ids of the resident chunks that are evicted together with it (a user
      message's last chunk and its reply's first: :func:`plan_room`); a chunk absent from it goes alone.
    """

    resident: tuple[Chunk, ...]
    scores: Mapping[int, float]
    active_tokens: int
    budget: Budget
    sink_count: int
    protected: frozenset[int] = frozenset()
    units: Mapping[int, frozenset[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Eviction:
    """One chunk to page out: its id, the budget's tokens it frees (:attr:`Chunk.cost`), its score, and
    whether it went past the scorer's floor (a chunk scoring >= 1.0 without a pin, taken when nothing else
    was left)."""

    chunk_id: int
    tokens: int
    score: float
    forced: bool = False


@dataclass(frozen=True)
class RoomPlan:
    """What :func:`plan_room` decided: the evictions in order and whether the new tokens then fit within
    ``max_active_tokens`` (when they do not, every chunk the rules let go is in ``evictions``)."""

    evictions: tuple[Eviction, ...]
    active_after: int
    fits: bool


def plan_room(residency: Residency, n: int, holding: frozenset[int] = frozenset()) -> RoomPlan:
    """The evictions that make room for ``n`` more tokens within the session's budget.

    Nothing when ``active + n`` is not over the budget's trigger. Otherwise, in four stages, each only
    while ``active + n`` is still above ``max_active_tokens`` after the one before:

    1. the lowest-scored evictable chunks down to the budget's target (neither this turn's protected chunks
       nor ``holding`` ones);
    2. the last resort: chunks scoring >= 1.0 without a pin go too, lowest score first (oldest first among
       ties), down to ``max_active_tokens``;
    3. the same, with a unit tied to a held chunk come apart (the question of the reply being written);
    4. the same, this turn's protected chunks included: their protection yields to the chunks held.

    A unit of ``residency.units`` (a user message's last chunk and its reply's first) goes whole, scored
    as its best chunk, or stays whole, so that the cache never holds a question without the start of its
    answer, nor a statement without its acknowledgement. A run of answerless questions reads to a chat
    model as turns it ignored: Qwen2.5-Coder-0.5B with its planted fact resident but the replies to the
    twelve questions after it paged out answered "What is my favourite number?" with "I'm sorry, but I
    don't have a favorite number"; from the same transcript with each reply cut to its first 61 tokens,
    or with those exchanges gone whole, it quoted the number (docs/memory-manager.md).
    """
    budget = residency.budget
    if not budget.over(residency.active_tokens + n):
        return RoomPlan((), residency.active_tokens, True)
    draft = _Draft(residency)
    keep = residency.protected | holding
    draft.take(draft.victims(n, budget.target(), keep, capped=False), forced=False)
    limit = budget.max_active_tokens
    if draft.active + n > limit:
        draft.take(draft.victims(n, limit, keep, capped=True), forced=True)
    if draft.active + n > limit and holding:
        draft.take(draft.victims(n, limit, keep, capped=True, loose=holding), forced=True)
    if draft.active + n > limit and residency.protected:
        draft.take(draft.victims(n, limit, holding, capped=True, loose=holding), forced=True)
    return RoomPlan(tuple(draft.evictions), draft.active, draft.active + n <= limit)


def pressure_victim(
    residency: Residency, holding: frozenset[int] = frozenset()
) -> tuple[Eviction, ...] | None:
    """What goes next when the shared pool is at its cap: the lowest-scored evictable unit (a chunk, or an
    exchange's seam whole, as :func:`plan_room` takes it) that is neither protected this turn nor held;
    failing that, the same with a unit tied to a held chunk come apart; failing that, the lowest-scored
    one not held, protected or not; None when nothing may go."""
    guarded = residency.protected | holding
    rounds: tuple[tuple[frozenset[int], frozenset[int]], ...] = (
        (guarded, frozenset()),
        (guarded, holding),
        (holding, holding),
    )
    for keep, loose in dict.fromkeys(rounds):  # each distinct round once (without holdings, one or two)
        units = _loosen(residency.units, loose)
        victims = select_victims(
            residency.resident,
            residency.scores,
            residency.active_tokens,
            0,
            keep,
            residency.sink_count,
            units,
        )
        if victims:
            return _first_unit(residency, victims, units)
    return None


def cheapest_elsewhere(residencies: Mapping[str, Residency]) -> tuple[str, tuple[Eviction, ...]] | None:
    """Among other sessions (``residencies``, each with its own turn's protections kept), the session and
    the unit with the lowest score (a unit scores as its best chunk) that may be paged out to relieve the
    pool; None when none may."""
    best: tuple[str, tuple[Eviction, ...]] | None = None
    for key, residency in residencies.items():
        victims = select_victims(
            residency.resident,
            residency.scores,
            residency.active_tokens,
            0,
            residency.protected,
            residency.sink_count,
            residency.units,
        )
        if victims:
            unit = _first_unit(residency, victims, residency.units)
            if best is None or _score(unit) < _score(best[1]):
                best = (key, unit)
    return best


def pool_victim(
    own: Residency, others: Mapping[str, Residency], holding: frozenset[int] = frozenset()
) -> tuple[str | None, tuple[Eviction, ...]] | None:
    """What leaves a pool at its cap so that a session (``own``) can go on: the cheapest unit of the other
    sessions that may give (:func:`cheapest_elsewhere`) first, as ``(their key, evictions)``, else the
    session's own (:func:`pressure_victim`, never ``holding``), as ``(None, evictions)``; None when none
    may go."""
    elsewhere = cheapest_elsewhere(others)
    if elsewhere is not None:
        return elsewhere
    mine = pressure_victim(own, holding)
    return None if mine is None else (None, mine)


def _first_unit(
    residency: Residency, victims: list[Chunk], units: Mapping[int, frozenset[int]]
) -> tuple[Eviction, ...]:
    """The first of ``select_victims``' picks with the rest of its unit in ``units`` (they come first)."""
    first = victims[0].chunk_id
    unit = units.get(first, frozenset({first}))
    return tuple(
        Eviction(c.chunk_id, c.cost, residency.scores[c.chunk_id]) for c in victims if c.chunk_id in unit
    )


def _score(unit: tuple[Eviction, ...]) -> float:
    """A unit's score: its best chunk's."""
    return max(e.score for e in unit)


def _loosen(units: Mapping[int, frozenset[int]], holding: frozenset[int]) -> Mapping[int, frozenset[int]]:
    """``units`` without those tied to a held chunk (the question of the reply being written goes alone)."""
    return {i: u for i, u in units.items() if not u & holding} if holding else units


def affordable(
    groups: Sequence[tuple[int, list[int]]],
    chunks: Mapping[int, Chunk],
    room: int,
    top_k: int,
) -> list[tuple[int, list[int]]]:
    """The best-ranked recovery groups (``(best chunk id, [chunk ids])``, best first), at most ``top_k``,
    whose tokens fit in ``room`` together. A group that does not fit whole comes back as the message of its
    best chunk (an exchange's user message without its reply), or failing that as the best chunk alone."""
    chosen: list[tuple[int, list[int]]] = []
    for best, group in groups:
        if len(chosen) == top_k:
            break
        message = [i for i in group if chunks[i].message_index == chunks[best].message_index]
        for option in (group, message, [best]):
            size = sum(chunks[i].num_tokens for i in option)
            if size <= room:
                chosen.append((best, option))
                room -= size
                break
    return chosen


class _Draft:
    """A plan being built: the chunks still resident and the tokens left after the evictions so far."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self.left = list(residency.resident)
        self.active = residency.active_tokens
        self.evictions: list[Eviction] = []

    def victims(
        self, n: int, target: int, keep: frozenset[int], capped: bool, loose: frozenset[int] = frozenset()
    ) -> list[Chunk]:
        """select_victims over what is left; ``capped``: scores >= 1.0 count as just below 1.0 (so
        unpinned "prefer" chunks may go, in age order among themselves); ``loose``: the units holding one
        of these chunks come apart."""
        r = self.residency
        scores = {i: min(s, 1.0 - 1e-9) for i, s in r.scores.items()} if capped else r.scores
        return select_victims(
            self.left, scores, self.active + n, target, keep, r.sink_count, _loosen(r.units, loose)
        )

    def take(self, victims: list[Chunk], forced: bool) -> None:
        gone = {c.chunk_id for c in victims}
        self.left = [c for c in self.left if c.chunk_id not in gone]
        for chunk in victims:
            self.active -= chunk.cost
            self.evictions.append(
                Eviction(chunk.chunk_id, chunk.cost, self.residency.scores[chunk.chunk_id], forced)
            )


@dataclass(frozen=True)
class SessionView:
    """A resident session (one branch of a client's session) as the pool's planner sees it.

    - ``last_used``: when a request last used it (the larger, the more recent);
    - ``blocks``: the pool blocks its cache holds;
    - ``idle``: it may swap out to make room for another session (no other client's request runs on it);
    - ``running``: a request runs on it now (the scheduler reserved its blocks);
    - ``swappable``: it can be paged out whole (its backend keeps a store).
    """

    key: str
    last_used: float
    blocks: int
    idle: bool
    running: bool
    swappable: bool


@dataclass(frozen=True)
class Swap:
    """One session to swap out: for the count of resident sessions, or (``preempted``) for the pool's cap,
    which then leaves ``blocks_free`` blocks beside the ones still held."""

    key: str
    preempted: bool = False
    blocks_free: int = 0


def plan_swaps(others: Sequence[SessionView], max_sessions: int, room_blocks: int | None) -> list[Swap]:
    """The resident sessions to swap out, in order, before a request's session comes in (``others``: every
    other resident session):

    1. while more than ``max_sessions`` would be resident (the request's own counted), the least recently
       used idle ones (one that cannot swap keeps its place in the count);
    2. under a pool cap (``room_blocks``: what the running requests' reservations leave of it; None without
       a cap), the least recently used that no request runs on, while the ones still resident hold more
       blocks than that.
    """
    idle = sorted((s for s in others if s.idle), key=lambda s: s.last_used)
    over = max(0, len(others) + 1 - max_sessions)
    swaps = [Swap(s.key) for s in idle[:over] if s.swappable]
    if room_blocks is None:
        return swaps
    gone = {s.key for s in swaps}
    parked = sorted((s for s in others if not s.running and s.key not in gone), key=lambda s: s.last_used)
    held = sum(s.blocks for s in parked)
    for s in parked:
        if held <= room_blocks:
            break
        if s.swappable:
            held -= s.blocks
            swaps.append(Swap(s.key, preempted=True, blocks_free=room_blocks - held))
    return swaps


def stale_branches(last_used: Mapping[str, float], keep: str, limit: int) -> list[str]:
    """The branches (key -> when last used) to close so that one more fits within ``limit``: the least
    recently used first, never ``keep`` (the branch the new one forks from)."""
    over = len(last_used) + 1 - limit
    if over <= 0:
        return []
    return sorted((k for k in last_used if k != keep), key=lambda k: last_used[k])[:over]


@dataclass(frozen=True)
class Cut:
    """What :func:`plan_truncate` decided: the history's ``length`` after the cut, the resident chunk the
    cut falls inside and how many of its tokens stay (``trim``: ``(chunk id, tokens kept)``, or None), and
    the chunks that go whole (``discard``, the latest first)."""

    length: int
    trim: tuple[int, int] | None
    discard: tuple[int, ...]


def plan_truncate(chunks: Sequence[Chunk], length: int) -> Cut:
    """How to cut a session's history (``chunks``, every chunk of it) to ``length`` tokens: when a client
    re-sends a conversation that departs from the history, or a cancelled reply is taken back.

    Every chunk that starts at or after ``length`` goes. A resident chunk the cut falls inside keeps its
    first tokens (its K/V are in the pool, cut there); a chunk the cut falls inside that is not resident
    goes whole (its saved K/V are one unit), and the length kept is then its start.
    """
    discard: list[int] = []
    trim = None
    for chunk in sorted(chunks, key=lambda c: c.original_start, reverse=True):
        if chunk.original_end <= length:
            break
        if chunk.original_start < length and chunk.resident:
            trim = (chunk.chunk_id, length - chunk.original_start)
            break
        length = min(length, chunk.original_start)
        discard.append(chunk.chunk_id)
    return Cut(length, trim, tuple(discard))
