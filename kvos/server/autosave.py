"""Autosave: snapshot the changed, idle sessions every ``interval`` seconds and once at shutdown.

The writing itself runs under the engine's scheduler like a request (it touches only idle sessions, and no
other work runs while it does); this thread only wakes up and hands it over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

_log = logging.getLogger("kvos.server.state")


class Autosave:
    """Runs ``write`` (which returns how many sessions it wrote) on ``engine`` every ``interval`` seconds
    (0: never) between :meth:`start` and :meth:`stop`, and once more at :meth:`stop`."""

    def __init__(self, write: Callable[[], int], engine: Executor, interval: float) -> None:
        self.write, self.engine, self.interval = write, engine, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvos-autosave", daemon=True)

    def start(self) -> None:
        if self.interval > 0:
            self._thread.start()

    def stop(self) -> None:
        """Stop the periodic writes and write once more (a clean shutdown keeps every idle session)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        written = self._run()
        _log.info("shutdown: %d sessions written to the state dir", written)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._run()

    def _run(self) -> int:
        try:
            written, seconds = self.engine.submit(self._timed).result()
        except Exception:  # a failed write must not stop the server or later writes
            _log.exception("writing sessions to the state dir failed")
            return 0
        if written:
            _log.info("state dir: %d sessions written in %.0f ms", written, seconds * 1000)
        return written

    def _timed(self) -> tuple[int, float]:
        """``write`` under the scheduler: (sessions written, seconds it took)."""
        began = time.perf_counter()
        return self.write(), time.perf_counter() - began
