"""The C heap under kvos's host tensors (glibc's malloc): give its free pages back, cap its arenas; and
the advice that asks Linux for 2 MB pages under a block of memory.

Saved K/V that outlives requests does not live here (:mod:`kvos.memory.mapped`); what does (a load's
temporaries, a request's tensors and objects) is freed into the heap, which keeps it resident until asked.
Both functions are no-ops where glibc is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys

M_ARENA_MAX = -8  # glibc's mallopt parameter
MADV_HUGEPAGE = 14  # Linux's madvise advice


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, found once: ``find_library`` runs ``ldconfig -p`` in a child process (~1 ms from a
    server holding a model), and every deleted session's clean-up asks."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): a model load frees many
    temporaries (per-part weights before fusing, dequantized rows; 11 MiB of a SmolLM2 Q4_1 load), a deleted
    session its records. ``malloc_trim`` trims the main heap's top but not another arena's:
    :func:`limit_heap_arenas`."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)


def limit_heap_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``), before threads start: every thread that
    allocates otherwise gets an arena of its own (up to 8 per core), and memory freed in one stays
    there, out of :func:`release_free_heap`'s reach (a server whose requests run on worker threads keeps
    tens of MB after its sessions are gone). True when set; False where glibc is absent."""
    try:
        return bool(_libc().mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the ``nbytes`` from ``address`` (page-aligned; best 2 MB-aligned, and untouched:
    the advice applies to the pages faulted in after it) with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``). Whether the kernel took the advice; False off Linux or without libc."""
    if not sys.platform.startswith("linux"):
        return False
    length = -(-nbytes // 4096) * 4096
    try:
        return bool(_libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0)
    except (OSError, AttributeError):
        return False
