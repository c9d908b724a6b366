"""An advisory file lock between processes (``fcntl.flock``), released by the OS when its holder dies."""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the exclusive lock of the file ``path`` (created if missing, never removed: removing a lock
    file that another process is about to lock would let two holders in). When another process holds it,
    ``on_wait`` is called once, then this blocks until the lock is free."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
