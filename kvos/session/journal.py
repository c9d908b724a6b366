"""The session's event log and counters."""

from __future__ import annotations

from collections import Counter
from typing import Any


class Journal:
    """Every paging event (evict, restore, recompute, drop, focus) with its turn and details, and counts.

    A ``tokens`` detail also accumulates under ``"<kind>_tokens"``.
    """

    def __init__(self, max_events: int = 10000) -> None:
        self.events: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.max_events = max_events
        self.max_active = 0

    def log(self, turn: int, kind: str, **detail: Any) -> None:
        self.counts[kind] += 1
        if "tokens" in detail:
            self.counts[f"{kind}_tokens"] += int(detail["tokens"])
        self.events.append({"turn": turn, "event": kind, **detail})
        if len(self.events) > self.max_events:
            del self.events[: len(self.events) - self.max_events]

    def seen(self, active_tokens: int) -> None:
        """Record the session's resident token count after a change."""
        self.max_active = max(self.max_active, active_tokens)

    def count(self, key: str) -> int:
        return self.counts[key]
