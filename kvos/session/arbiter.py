"""The pool's arbiter: the one owner of what leaves the shared KV pool when it is at its cap.

A session's operation asks it for room before it takes blocks (:meth:`PoolArbiter.reserve`); the arbiter
asks the pool, and while the pool cannot give them, the planner names one unit to page out (a chunk, or an
exchange's seam whole: :func:`~kvos.policy.planner.pool_victim`, the lowest-scored of the other idle
sessions first, then the requester's own) and its session's memory carries it out. Sessions ask; nothing
here is called back."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvos.memory.pool import KVPool
from kvos.policy.planner import pool_victim

if TYPE_CHECKING:
    from kvos.session.memory import SessionMemory


class PoolArbiter:
    """Room in ``pool`` for the sessions that joined, never at the cost of a ``running`` one."""

    def __init__(self, pool: KVPool, running: set[str] | None = None) -> None:
        """``running``: ids of sessions with a request in flight (their passes may be waiting in a batched
        step): another session's pressure never pages them out."""
        self.pool = pool
        self.running: set[str] = running if running is not None else set()
        self.members: dict[str, SessionMemory] = {}

    def join(self, memory: SessionMemory) -> None:
        self.members[memory.session_id] = memory

    def leave(self, session_id: str) -> None:
        self.members.pop(session_id, None)

    def reserve(self, requester: SessionMemory, blocks: Callable[[], int], holding: set[int]) -> bool:
        """Make sure the pool can allocate ``blocks()`` more blocks for ``requester`` (asked again after
        each eviction: what an operation needs may change as the cache does), paging out one planned
        unit at a time, never ``holding`` ones of the requester. False when nothing more may go and the
        pool still cannot hold them."""
        while not self.pool.can_allocate(blocks()):
            others = {
                sid: m.residency()
                for sid, m in self.members.items()
                if m is not requester and sid not in self.running
            }
            choice = pool_victim(requester.residency(), others, frozenset(holding))
            if choice is None:
                return False
            owner_id, evictions = choice
            owner = requester if owner_id is None else self.members[owner_id]
            for eviction in evictions:
                owner.carry_out([eviction])
                if owner is requester:
                    owner.log("pool_full", chunk=eviction.chunk_id)
                else:
                    owner.log("pressure", chunk=eviction.chunk_id, by=requester.session_id)
        return True
