"""The C heap's helpers find the C library once (:mod:`kvos.memory.heap`): every deleted session's clean-up
trims the heap, and looking the library up runs ``ldconfig -p`` in a child process each time."""

from __future__ import annotations

import ctypes.util

import pytest

from kvos.memory import heap


def test_the_c_library_is_looked_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    lookups: list[str] = []
    real = ctypes.util.find_library

    def counted(name: str) -> str | None:
        lookups.append(name)
        return real(name)

    monkeypatch.setattr(ctypes.util, "find_library", counted)
    heap._libc.cache_clear()
    for _ in range(3):
        heap.release_free_heap()
    assert lookups == ["c"]
