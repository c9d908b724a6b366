"""Chat sessions over the engine and the memory policy: chunks, budgets, paging, recovery."""

from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.session import Session

__all__ = ["MemoryManager", "Session", "SessionConfig"]
