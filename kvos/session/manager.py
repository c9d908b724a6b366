"""The memory manager: sessions sharing one engine and one pool, each within its own budget.

When the shared pool reaches its ``max_bytes`` cap, a session that needs room does not fail: the pool's
arbiter (:mod:`kvos.session.arbiter`) pages out the lowest-scored evictable chunks of the other sessions
first.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.memory.growth import GrowthPolicy
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, load_tokenizer
from kvos.session.arbiter import PoolArbiter
from kvos.session.branch import fork
from kvos.session.config import SessionConfig
from kvos.session.session import Session, StoreFactory


class MemoryManager:
    """Creates sessions over one engine and arbitrates the pool between them."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        config: SessionConfig | None = None,
        store_factory: StoreFactory | None = None,
    ) -> None:
        """``store_factory``: how a session's chunk store is built (default: from the session config)."""
        self.engine, self.tokenizer = engine, tokenizer
        self.config = config or SessionConfig()
        self.store_factory = store_factory
        self.sessions: dict[str, Session] = {}
        # sessions with a request in flight (its forward passes may wait in a batched step): never paged
        # out by another session's pressure
        self.running: set[str] = set()
        self.arbiter = PoolArbiter(engine.pool, self.running)
        self._ids = itertools.count(1)
        self._template: ChatTemplate | None = None

    @classmethod
    def from_path(
        cls,
        model: str | Path,
        config: SessionConfig | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        growth: GrowthPolicy | None = None,
        block_size: int = 16,
    ) -> MemoryManager:
        """Load a Hugging Face model directory (with its tokenizer) and build a manager over it."""
        engine = Engine(load_model(model, dtype, device), block_size=block_size, growth=growth)
        return cls(engine, load_tokenizer(model), config)

    def session(self, session_id: str | None = None, config: SessionConfig | None = None) -> Session:
        """The session with this id, created (with ``config`` or the manager's default) if it is new."""
        if session_id is None:
            session_id = f"s{next(self._ids)}"
        if session_id not in self.sessions:
            self.sessions[session_id] = Session(
                session_id,
                self.engine,
                self.tokenizer,
                config or self.config,
                arbiter=self.arbiter,
                store_factory=self.store_factory,
            )
            self.arbiter.join(self.sessions[session_id].memory)
        elif config is not None:
            raise ConfigError(f"session {session_id!r} exists already; its config cannot change")
        return self.sessions[session_id]

    def fork(self, parent_id: str, session_id: str, length: int) -> Session:
        """A new session ``session_id`` holding the first ``length`` tokens of session ``parent_id``'s
        history, sharing its resident K/V by reference (:func:`kvos.session.branch.fork`)."""
        if session_id in self.sessions:
            raise ConfigError(f"session {session_id!r} exists already")
        parent = self.sessions[parent_id]
        child = Session(
            session_id,
            self.engine,
            self.tokenizer,
            parent.config,
            arbiter=self.arbiter,
            store_factory=self.store_factory,
        )
        try:
            fork(parent, child, length)
        except BaseException:
            child.close()
            raise
        self.sessions[session_id] = child
        self.arbiter.join(child.memory)
        return child

    def session_template(self) -> ChatTemplate | None:
        """The model's chat template (None when its tokenizer has none)."""
        if self._template is None and self.tokenizer.chat_template:
            self._template = ChatTemplate.from_tokenizer(self.tokenizer)
        return self._template

    def close(self, session_id: str) -> None:
        """End a session: its pool blocks and saved chunks are freed."""
        self.detach(session_id).close()

    def detach(self, session_id: str) -> Session:
        """Take a session out of the manager without freeing anything (its caller closes it later, where
        chunks may be freed): its name is free for a new session at once."""
        self.arbiter.leave(session_id)
        return self.sessions.pop(session_id)

    def stats(self) -> dict[str, Any]:
        pool = self.engine.pool
        return {
            "pool_bytes": pool.nbytes,
            "pool_live_bytes": pool.live_bytes,
            "pool_resizes": pool.resizes,
            "sessions": {sid: s.stats() for sid, s in self.sessions.items()},
        }
