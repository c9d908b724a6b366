"""Python's garbage collector in a long-running server: every collection's pause counted.

A full collection walks every object the collector tracks with the interpreter lock held: nothing else in
the process runs meanwhile, no session's turn and no stream. After ``kvos serve`` has loaded a GGUF model
there are ~200,000 such objects (the tokenizer's tables, the modules, the model's bookkeeping), and a full
collection takes 115-130 ms on an AMD Zen 5 core: about one in a 20 s run of 8 streaming clients, a hiccup
of every stream. Freezing start-up's objects out of the collector (``gc.freeze``) would make that 2-4 ms, but
measured it cost more than it saved: with it, the same runs decoded 253-262 tok/s against 273-288 and their
ITL p95 was 52-54 ms against 31-34, repeatably and in either order (docs/benchmarks.md), so kvos does not
freeze.

:class:`Pauses` (installed once, :func:`watch`) adds each collection's duration to its generation's total,
and ``/metrics`` exports them (``kvos_gc_pause_seconds``, ``kvos_gc_collections``,
``kvos_gc_pause_longest_seconds``), so that a pause long enough to show in latency can be told from the
model's.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pauses:
    """The collections seen since :func:`watch` installed it, per generation (0, 1, 2): how many, their
    seconds in all, and the longest."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest: float = 0.0
    _began: float | None = field(default=None, repr=False)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``' signature: called at the start and at the stop of every collection (on the
        thread that triggered it, which holds the interpreter lock: no other collection overlaps)."""
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:
            return  # installed during a collection
        took, self._began = time.perf_counter() - self._began, None
        generation = min(int(info.get("generation", 2)), 2)
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest = max(self.longest, took)


_lock = threading.Lock()
_pauses: Pauses | None = None


def watch() -> Pauses:
    """The process's :class:`Pauses`, installed in ``gc.callbacks`` on first call."""
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = Pauses()
            gc.callbacks.append(_pauses)
        return _pauses
