"""Python's garbage collector in a long-running server: start-up's objects frozen, every pause counted.

A full collection walks every object the collector tracks with the interpreter lock held: nothing else in
the process runs meanwhile, no session's turn and no stream. After ``kvos serve`` has loaded a GGUF model
there are ~220,000 such objects (the tokenizer's tables, the modules, the model's bookkeeping), and a full
collection took 115-130 ms on an AMD Zen 5 core: about one in a 20 s run of 8 streaming clients, a hiccup
of every stream. Those objects live as long as the server, so ``kvos serve`` freezes them out of the
collector once it has loaded everything (:func:`freeze_startup`, ``gc.freeze``): a full collection then
walks only what was made since, 2-4 ms. (Session 27 measured the freeze slower served, 253-262 against
273-288 tok/s; on the code of session 33, eight alternated runs of 8 clients x 6 turns gave 372-378 tok/s
frozen against 369-388 not, ITL p95 24-26 against 24-26 ms: no cost left to weigh against the pauses,
docs/benchmarks.md.)

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


def freeze_startup() -> int:
    """Collect once, then put every object the collector tracks out of its reach for good (``gc.freeze``):
    what start-up built lives as long as the process, and later full collections walk only what came
    after. Returns how many objects are frozen (``gc.get_freeze_count``)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
