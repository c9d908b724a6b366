"""Which session a request gets: sessions per API key, their branches, routing, busy and cancelled requests,
swapping sessions in and out of the pool.

The registry (which session exists, who owns it, whether it is busy) is guarded by a condition variable, so
the HTTP layer can answer (or wait) at once; what touches a session's cache (:meth:`choose_branch`,
:meth:`make_resident`, :meth:`delete`) runs under the scheduler.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvos.engine.scheduler import Scheduler
from kvos.errors import PoolOutOfMemoryError
from kvos.memory.heap import release_free_heap
from kvos.policy.planner import SessionView, plan_swaps, stale_branches
from kvos.server.errors import busy, not_found
from kvos.server.state import StateDir
from kvos.session.branch import shareable_length
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span, SpanRenderer, common_prefix, flatten
from kvos.session.session import Session


@dataclass
class ServiceConfig:
    model_name: str
    model_aliases: tuple[str, ...] = ()  # other ids accepted for the model (--model-alias)
    max_sessions: int = 8  # sessions resident in the pool at once; the least recently used idle ones swap out
    session_ttl_s: float = 3600.0
    busy_timeout_s: float = 300.0  # how long a request waits for its busy session; 0: 409 at once
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 4096
    default_max_tokens: int | None = None  # without max_tokens: as long as the reply's room allows
    max_branches: int = 4  # conversation branches kept per session; the least recently used goes first
    cancel_wait_s: float = 30.0  # how long DELETE waits for a cancelled request to let go of its session
    keep_thinking: bool = False
    prefix_min_tokens: int = 64
    state_interval_s: float = 60.0  # with a state dir: how often changed idle sessions are written (0: never)
    max_running: int = 8  # requests running at once, their forward passes batched; later ones wait
    step_tokens: int = 2048  # tokens per batched forward pass: every decode token, then prefill slices
    stall: float | None = 3.0  # a step with prefill beside decodes lasts about this many decode steps at most
    threads: int | None = None  # torch's intra-op threads for the forward passes (None: the default count)


@dataclass(frozen=True, eq=False)
class Watcher:
    """Who is told of events (:meth:`Registry.watch`): an owner's sessions (None: all), or one of them."""

    owner: str | None
    session_id: str | None
    watch: Callable[[dict[str, Any]], None]


@dataclass
class Entry:
    """A client's session: its branches (sessions of the manager sharing a prefix by reference), the one
    the latest request used first, and the request running on it, if any."""

    session_id: str
    owner: str
    renderer: SpanRenderer | None
    branches: list[Session]
    busy: bool = False
    served: int = 0  # requests that reached the model
    last_used: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    branch_used: dict[str, float] = field(default_factory=dict)
    hub: Callable[[Entry, dict[str, Any]], None] | None = None  # hands its events to the registry's watchers

    @property
    def session(self) -> Session:
        """The branch of the latest request."""
        return self.branches[0]

    def adopt(self, branch: Session) -> None:
        """Have a branch's events reach the session's watchers (:meth:`publish`)."""
        branch.on_event(lambda s, event: self.publish({**event, "branch": self.branch_name(s)}))

    def publish(self, event: dict[str, Any]) -> None:
        """Tell the session's watchers (:meth:`Registry.watch`) of ``event``."""
        if self.hub is not None:
            self.hub(self, event)

    def branch_name(self, session: Session) -> str:
        """A branch's public name: ``main`` for the first, ``b1``, ``b2``, ... for the forks."""
        return session.session_id.rsplit("#", 1)[1] if "#" in session.session_id else "main"


# The longest that closed sessions' memory waits for the server to be idle: past it, it is reclaimed
# between two steps (one gap in the streams, at most once this often under a load that never pauses).
RECLAIM_WAIT_S = 60.0


def reclaim_memory() -> None:
    """Free what closed sessions left in reference cycles (their chunks' records, the requests that ran on
    them: otherwise kept until the collector's next full pass, which may be hours away) and hand the heap
    they freed back to the system (which the allocator would otherwise keep resident): after its sessions
    are deleted a long-running server's RSS goes back down, not to stay at its high-water mark."""
    gc.collect()
    release_free_heap()


class SessionRegistry:
    """The sessions of every API key, each with its branches."""

    def __init__(self, manager: MemoryManager, config: ServiceConfig, state: StateDir | None = None) -> None:
        """``state``: where sessions are written to survive a restart, and read back from (lazily)."""
        self.manager, self.config, self.state = manager, config, state
        self.entries: dict[tuple[str, str], Entry] = {}
        self.saving: set[tuple[str, str]] = set()  # being written to the state dir: not to be expired
        self.expired: list[Session] = []  # branches of expired sessions, to be closed under the scheduler
        self.cond = threading.Condition()
        self.watchers: list[Watcher] = []
        self.scheduler: Scheduler | None = None  # the server's: whose reservations bound a swap-in
        self._reclaim_due: float | None = None  # since when closed sessions' memory waits to be reclaimed

    def watch(
        self, owner: str | None, watch: Callable[[dict[str, Any]], None], session_id: str | None = None
    ) -> Callable[[], None]:
        """Tell ``watch`` of every event of ``owner``'s sessions (None: every owner's, each event with its
        ``owner``), or of one of them (``session_id``), from now on: each with its ``session``, sessions
        opening and closing (``open``, ``close``) among them. Returns the function that stops it. ``watch``
        runs on the thread that causes the event, so it must only hand the event on."""
        watcher = Watcher(owner, session_id, watch)
        self.watchers.append(watcher)
        return lambda: self.watchers.remove(watcher)

    def _announce(self, entry: Entry, event: dict[str, Any]) -> None:
        """Hand one of ``entry``'s events to the watchers that see it (:meth:`watch`)."""
        tagged = {**event, "session": entry.session_id}
        for w in list(self.watchers):
            if w.session_id not in (None, entry.session_id) or w.owner not in (None, entry.owner):
                continue
            w.watch(tagged if w.owner is not None else {**tagged, "owner": entry.owner})

    def acquire(self, owner: str, session_id: str | None, probe: list[int] | None) -> Entry:
        """The session for a request, marked busy: by id, else by the longest shared prefix, else new."""
        with self.cond:
            self._expire()
            deadline = time.monotonic() + self.config.busy_timeout_s
            # found again after every wait: a session being deleted is busy until it is gone
            while (entry := self._find(owner, session_id, probe)).busy:
                left = deadline - time.monotonic()
                if entry.cancel.is_set():  # a cancelled request lets go within one decode step
                    left = max(left, self.config.cancel_wait_s)
                if left <= 0:
                    raise busy(entry.session_id)
                self.cond.wait(min(left, 0.1))
            entry.busy = True
        return entry

    def release(self, entry: Entry, abandoned: bool = False) -> None:
        """The request on ``entry`` is over. ``abandoned``: it was rejected before reaching the model, so a
        session it created is removed again (a rejected request leaves nothing behind)."""
        with self.cond:
            entry.busy, entry.last_used = False, time.monotonic()
            entry.cancel = threading.Event()
            key = (entry.owner, entry.session_id)
            if abandoned and not entry.served and self.entries.get(key) is entry:
                self._close(key, "rejected")
            self.cond.notify_all()

    def _find(self, owner: str, session_id: str | None, probe: list[int] | None) -> Entry:
        if session_id is not None:
            found = self.entries.get((owner, session_id))
            state = self.state
            if found is not None and not found.busy and state is not None and state.stale(owner, session_id):
                self._retire((owner, session_id), "stale")  # another replica served it since
                found = None
            found = found or self._restore(owner, session_id)
            return found or self._create(owner, session_id)
        best, best_len = None, self.config.prefix_min_tokens - 1
        for (who, _), entry in self.entries.items():
            if who == owner and probe is not None:
                shared = max(common_prefix(probe, b.token_ids()) for b in entry.branches)
                if shared > best_len:
                    best, best_len = entry, shared
        if best is None and probe is not None and self.state is not None:
            live = {sid for who, sid in self.entries if who == owner}
            stored = self.state.match(owner, probe, self.config.prefix_min_tokens, live)
            best = self._restore(owner, stored) if stored is not None else None
        return best or self._create(owner, uuid.uuid4().hex[:16])

    def _create(self, owner: str, session_id: str) -> Entry:
        return self._add(owner, session_id, [self.manager.session(f"{owner}/{session_id}")])

    def _add(self, owner: str, session_id: str, branches: list[Session]) -> Entry:
        session = branches[0]
        renderer = SpanRenderer(session.template, session.tokenizer) if session.template else None
        entry = Entry(session_id, owner, renderer, branches, hub=self._announce)
        for branch in branches:
            entry.adopt(branch)
        now = time.monotonic()  # the branches' order (latest first) is their recency
        entry.branch_used = {b.session_id: now - i * 1e-3 for i, b in enumerate(branches)}
        self.entries[(owner, session_id)] = entry
        self._announce(entry, {"event": "open", "branches": len(branches)})
        return entry

    def _restore(self, owner: str, session_id: str) -> Entry | None:
        """A session of the state dir, back in the registry (swapped out: its K/V come back from disk when
        a request first uses it); None when the state dir has none."""
        stored = self.state.load(owner, session_id, self.manager) if self.state is not None else None
        if stored is None:
            return None
        entry = self._add(owner, session_id, stored[0])
        entry.served = stored[1]
        return entry

    def _expire(self) -> bool:
        """Take the sessions idle past their TTL out of the registry and the manager (no request finds
        them again, and their ids are free at once); whether any was. Their pool blocks and saved chunks are
        freed by :meth:`close_expired`, under the scheduler: this runs beside the forward passes."""
        now = time.monotonic()
        expired = [
            key
            for key, entry in self.entries.items()
            if not entry.busy and key not in self.saving and now - entry.last_used > self.config.session_ttl_s
        ]
        for key in expired:
            self._retire(key, "expired")
            if self.state is not None:
                self.state.forget(*key, everywhere=False)  # the shared tier's copy may be another's
        return bool(expired)

    def _retire(self, key: tuple[str, str], reason: str) -> None:
        """Take a session out of the registry and the manager now (its id is free at once); its branches
        are closed by :meth:`close_expired`, under the scheduler."""
        entry = self.entries.pop(key)
        self._announce(entry, {"event": "close", "reason": reason})
        self.expired.extend(self.manager.detach(b.session_id) for b in entry.branches)

    def close_expired(self) -> None:
        """On the engine: close the sessions :meth:`acquire` found expired, reclaim their memory, and
        shrink the pool when it is empty."""
        with self.cond:
            doomed, self.expired = self.expired, []
        while doomed:
            doomed.pop().close()
        self.manager.engine.pool.shrink()
        self._reclaim()

    def _close(self, key: tuple[str, str], reason: str = "deleted") -> None:
        """Close a session's branches (its caller reclaims the memory, outside the lock)."""
        entry = self.entries.pop(key)
        self._announce(entry, {"event": "close", "reason": reason})
        for branch in entry.branches:
            self.manager.close(branch.session_id)
        if self.state is not None:
            self.state.forget(*key)

    def snapshot_idle(self) -> int:
        """Write every idle session that changed since its last snapshot to the state dir; how many were
        written. Under the scheduler: it holds the turn from start to end (it runs no forward pass), so
        no request runs meanwhile, and the requests suspended between passes hold busy sessions, which are
        not written. Expiry, which runs elsewhere, leaves the sessions being written alone."""
        if self.state is None:
            return 0
        with self.cond:
            idle = [e for e in self.entries.values() if not e.busy and e.served]
            self.saving = {(e.owner, e.session_id) for e in idle}
        try:
            return sum(self.state.save(e.owner, e.session_id, e.served, e.branches) for e in idle)
        finally:
            with self.cond:
                self.saving = set()

    def sessions(self, owner: str) -> list[dict[str, Any]]:
        with self.cond:
            return [
                {
                    "id": sid,
                    "busy": e.busy,
                    "swapped": e.session.swapped,
                    **e.session.stats(),
                    "branches": [
                        {"name": e.branch_name(b), "history_tokens": b.history_tokens} for b in e.branches
                    ],
                }
                for (who, sid), e in self.entries.items()
                if who == owner
            ]

    def branch_of(self, owner: str, session_id: str, branch: str | None = None) -> tuple[Entry, Session]:
        """One of a key's sessions and one of its branches (by name; the latest request's by default); a
        404 for a session the key does not have (another key's included) or a branch it does not have."""
        with self.cond:
            entry = self.entries.get((owner, session_id))
            if entry is None:
                raise not_found(f"no session {session_id!r}", "session_not_found")
            for b in entry.branches:
                if branch is None or entry.branch_name(b) == branch:
                    return entry, b
        raise not_found(f"session {session_id!r} has no branch {branch!r}", "branch_not_found")

    def cancel(self, owner: str, session_id: str) -> bool:
        """Ask the request running on a session to stop (within one decode step); False when none runs."""
        with self.cond:
            entry = self.entries.get((owner, session_id))
            if entry is None or not entry.busy:
                return False
            entry.cancel.set()
            return True

    def claim(self, owner: str, session_id: str) -> bool:
        """The first half of a delete, off the engine: cancel a request running on the session, wait for
        it to let go (up to ``cancel_wait_s``: 409 after that) and mark the session busy, so that no new
        request takes it before :meth:`close` does. False: the session was only in the state dir, and is
        forgotten there. A session nobody has is a 404."""
        self.cancel(owner, session_id)
        with self.cond:
            entry = self.entries.get((owner, session_id))
            if entry is None and self.state is not None and self.state.has(owner, session_id):
                self.state.forget(owner, session_id)  # stored, not loaded since the restart
                return False
            if entry is None:
                raise not_found(f"no session {session_id!r}", "session_not_found")
            deadline = time.monotonic() + self.config.cancel_wait_s
            while entry.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise busy(session_id)
                self.cond.wait(left)
            entry.busy = True
            return True

    def close(self, owner: str, session_id: str) -> None:
        """The second half of a delete, under the scheduler: close a claimed session's branches, reclaim their
        memory, and shrink the pool back to its start size when it is empty. Only the key is passed, so
        that no caller's frame keeps the session alive while its memory is reclaimed."""
        with self.cond:
            if (owner, session_id) in self.entries:
                self._close((owner, session_id))
            self.cond.notify_all()
        self.manager.engine.pool.shrink()
        self._reclaim()

    def run_under(self, scheduler: Scheduler) -> None:
        """Work under the server's scheduler: its reservations bound a swap-in, and the memory of sessions
        closed while others ran is reclaimed once it runs out of work (:meth:`_reclaim`)."""
        self.scheduler = scheduler
        scheduler.when_idle(self.reclaim_if_due)
        scheduler.after_turns(lambda: self.reclaim_if_due(RECLAIM_WAIT_S))

    def _reclaim(self) -> None:
        """:func:`reclaim_memory` now, unless other sessions are running under the scheduler: its full
        collection holds the interpreter lock (~140 ms with SmolLM2 loaded), a gap in every stream, so it
        then waits for :meth:`reclaim_if_due` (the scheduler's idle hook, or after the turns once it has
        waited :data:`RECLAIM_WAIT_S`)."""
        if self.scheduler is not None and self.scheduler.others_running():
            if self._reclaim_due is None:
                self._reclaim_due = time.monotonic()
            return
        self._reclaim_due = None
        reclaim_memory()

    def reclaim_if_due(self, waited: float = 0.0) -> None:
        """Reclaim the memory of sessions closed while others ran, if it has waited ``waited`` seconds."""
        due = self._reclaim_due
        if due is not None and time.monotonic() - due >= waited:
            self._reclaim_due = None
            reclaim_memory()

    def delete(self, owner: str, session_id: str) -> None:
        """Delete a session; a request running on it is cancelled first (and waited for). Not for work
        under the scheduler (it may wait for another request): the server claims, then closes."""
        if self.claim(owner, session_id):
            self.close(owner, session_id)

    def choose_branch(self, entry: Entry, prompt: list[int]) -> Session:
        """The branch a prompt continues: the one sharing its longest prefix, continued in place when the
        prompt departs from it only within its last turn (a new turn, a regenerated reply, an edited last
        message); otherwise a new branch forked at the shared prefix (a side request with another system
        prompt, an edit further back), sharing those pool blocks by reference. Branches past ``max_branches``
        go least recently used first; with ``max_branches`` 1 the branch is always continued in place
        (truncated at the divergence). The chosen branch becomes ``entry.session``."""
        shared = {b.session_id: common_prefix(prompt, b.token_ids()) for b in entry.branches}
        used = entry.branch_used
        best = max(entry.branches, key=lambda b: (shared[b.session_id], used.get(b.session_id, 0.0)))
        chosen = best
        if shared[best.session_id] < best.last_turn_start() and self.config.max_branches > 1:
            recency = {b.session_id: used.get(b.session_id, 0.0) for b in entry.branches}
            for key in stale_branches(recency, best.session_id, self.config.max_branches):
                entry.branches = [b for b in entry.branches if b.session_id != key]
                used.pop(key, None)
                self.manager.close(key)
            name = f"{entry.owner}/{entry.session_id}#b{entry.served}"
            chosen = self.manager.fork(best.session_id, name, shared[best.session_id])
            entry.branches.append(chosen)
            entry.adopt(chosen)
        entry.branches.remove(chosen)
        entry.branches.insert(0, chosen)
        entry.branch_used[chosen.session_id] = time.monotonic()
        return chosen

    def seed(self, entry: Entry, spans: list[Span], priority: float, pinned: bool) -> None:
        """A new session's first request: when another session of the same key holds at least
        ``prefix_min_tokens`` of the prompt's start (an agent's system prompt and tool schemas) with the hints
        this request gives it (:func:`~kvos.session.branch.shareable_length`), the new session starts as a
        fork of it: those tokens' K/V shared by reference instead of prefilled again. Only idle, resident
        sessions give their prefix (a running one's history is still changing); when none here does, a
        stored one (this replica's state dir, or another replica's session through the shared tier) is
        loaded, lends its prefix and is closed again (its stored copy stays as it was). Under the
        scheduler, before :meth:`choose_branch`."""
        if entry.served or entry.session.history_tokens:
            return
        with self.cond:  # held to the end: no donor expires or is taken meanwhile
            best, shared = self._live_donor(entry, spans, priority, pinned)
            lent = [] if best is not None else self._stored_donor(entry.owner, spans)
            if lent and (n := shareable_length(lent[0], spans, priority, pinned)) > shared:
                best, shared = lent[0], n
            try:
                if best is not None:
                    name = entry.session.session_id
                    self.manager.close(name)
                    child = self.manager.fork(best.session_id, name, shared)
                    entry.branches, entry.branch_used = [child], {name: time.monotonic()}
                    entry.adopt(child)
            finally:
                for branch in lent:  # lent for the fork only: the child keeps its share of the blocks
                    self.manager.close(branch.session_id)

    def _live_donor(
        self, entry: Entry, spans: list[Span], priority: float, pinned: bool
    ) -> tuple[Session | None, int]:
        """The idle, resident branch of another session of ``entry``'s key that the prompt may take the
        longest prefix from (at least ``prefix_min_tokens``), and that length; (None, min - 1) when none."""
        best, shared = None, self.config.prefix_min_tokens - 1
        for (who, _), e in self.entries.items():
            if who != entry.owner or e is entry or e.busy:
                continue
            for branch in e.branches:
                if branch.swapped or branch.session_id in self.manager.running:
                    continue
                if (n := shareable_length(branch, spans, priority, pinned)) > shared:
                    best, shared = branch, n
        return best, shared

    def _stored_donor(self, owner: str, spans: list[Span]) -> list[Session]:
        """The branches of the stored session of ``owner`` (this replica's state dir, or another replica's
        through the shared tier) that shares the longest prefix with the prompt, loaded and its latest
        branch swapped in to lend its prefix; [] when none does, or the pool has no room for it now."""
        if self.state is None:
            return []
        live = {sid for who, sid in self.entries if who == owner}
        found = self.state.match(owner, flatten(spans), self.config.prefix_min_tokens, live)
        stored = self.state.load(owner, found, self.manager) if found is not None else None
        if stored is None:
            return []
        branches = stored[0]
        try:
            branches[0].swap_in()
        except PoolOutOfMemoryError:
            for branch in branches:
                self.manager.close(branch.session_id)
            return []
        return branches

    def make_resident(self, entry: Entry) -> None:
        """Make room in the pool for this request, then swap its branch in if it was out. Idle sessions (no
        request running on them) are swapped out, least recently used first (their chunks go to their
        stores and come back exactly on their next request): while more than ``max_sessions`` sessions
        (branches count one each) would be resident, and, under a pool cap, while the idle ones hold more
        pool blocks than the running requests' reservations leave free (the scheduler admitted this
        request only with its own blocks reserved)."""
        running = self.manager.running
        with self.cond:
            others = [
                (e, b)
                for e in self.entries.values()
                for b in e.branches
                if b is not entry.session and not b.swapped and b.active_tokens
            ]
        views = [
            SessionView(
                b.session_id,
                e.branch_used.get(b.session_id, e.last_used),
                b.pool_blocks,
                idle=not e.busy or e is entry,
                running=b.session_id in running,
                swappable=b.can_swap,
            )
            for e, b in others
        ]
        by_key = {b.session_id: b for _, b in others}
        sched = self.scheduler
        room = None
        if sched is not None and sched.capacity_blocks is not None:
            room = max(0, sched.capacity_blocks - sched.reserved_blocks)
        for swap in plan_swaps(views, self.config.max_sessions, room):
            session = by_key[swap.key]
            session.swap_out()
            if swap.preempted:
                session.log("preempt", blocks_free=swap.blocks_free)
        if entry.session.swapped:
            entry.session.swap_in()
