"""The session's event log and counters."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
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
        self.observer: Callable[[dict[str, Any]], None] | None = None  # told of every event as it is logged

    def log(self, turn: int, kind: str, **detail: Any) -> None:
        self.counts[kind] += 1
        if "tokens" in detail:
            self.counts[f"{kind}_tokens"] += int(detail["tokens"])
        event = {"turn": turn, "event": kind, **detail}
        self.events.append(event)
        if len(self.events) > self.max_events:
            del self.events[: len(self.events) - self.max_events]
        if self.observer is not None:
            self.observer(event)

    def seen(self, active_tokens: int) -> None:
        """Record the session's resident token count after a change."""
        self.max_active = max(self.max_active, active_tokens)

    def count(self, key: str) -> int:
        return self.counts[key]


class TurnCosts:
    """Seconds spent per user message: finding what to bring back (``recovery_s``, the recovery signal),
    bringing it back (``restore_s``), prefilling the message itself (``prefill_s``) and making the key codes
    of the learned signal for what was prefilled since the message came, its reply included (``code_s``),
    and compressing the chunks sealed meanwhile (``compress_s``, :mod:`kvos.session.compressor`)."""

    KEYS = ("recovery_s", "restore_s", "prefill_s", "code_s", "compress_s")

    def __init__(self) -> None:
        self.turns: list[dict[str, float]] = []

    def begin_turn(self, **seconds: float) -> None:
        self.turns.append(dict.fromkeys(self.KEYS, 0.0))
        self.add(**seconds)

    def add(self, **seconds: float) -> None:
        """Add to the current turn's figures (outside a turn: nothing to add to, ignored)."""
        if self.turns:
            for key, value in seconds.items():
                self.turns[-1][key] += value

    @property
    def restore_s(self) -> float:
        return self.turns[-1]["restore_s"] if self.turns else 0.0

    def medians_ms(self) -> dict[str, float]:
        """See :func:`cost_medians`."""
        return cost_medians(self.turns)


def cost_medians(turns: list[dict[str, float]]) -> dict[str, float]:
    """Per-message medians in ms of :class:`TurnCosts` turns: ``recovery_ms_median``, ``restore_ms_median``,
    ``prefill_ms_median``, ``code_ms_median`` (0 without turns), ``recovery_over_prefill``, the median over
    the messages of each message's recovery signal time over its own prefill time, and
    ``recovery_and_codes_over_prefill``, the same with its key codes' time added to the signal's."""
    out = {
        f"{key[:-2]}_ms_median": round(1000 * statistics.median(t[key] for t in turns), 3) if turns else 0.0
        for key in TurnCosts.KEYS
    }
    ratios = [t["recovery_s"] / t["prefill_s"] for t in turns if t["prefill_s"] > 0]
    out["recovery_over_prefill"] = round(statistics.median(ratios), 4) if ratios else 0.0
    coded = [(t["recovery_s"] + t["code_s"]) / t["prefill_s"] for t in turns if t["prefill_s"] > 0]
    out["recovery_and_codes_over_prefill"] = round(statistics.median(coded), 4) if coded else 0.0
    return out
