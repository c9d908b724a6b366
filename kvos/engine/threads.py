"""Which thread computes with torch's intra-op threads.

On Linux torch parallelises its CPU operators (and kvos's kernels, through ``at::parallel_for``) with GNU
OpenMP, which keeps a pool of helper threads for *each* thread that runs a parallel region, for as long as
that thread lives. Once the pooled threads outnumber the CPUs, libgomp no longer lets idle helpers spin:
they sleep after every region and each region pays their wake-up through the kernel. A decode step of the
0.5B shape runs a few hundred small regions (the attention gather, its products and softmax, the norms),
so on 2 cores a second thread that had run a parallel operator once made every decode step 1.3-1.5x slower.

A process that computes on one thread and serves on others (``kvos serve``: the scheduler's thread runs
every forward pass; worker threads sample, page and stream) therefore
- does its set-up, which runs parallel operators, on a thread that ends (:func:`on_passing_thread`),
- makes one thread the default for every other thread (:func:`single_threaded_default`),
- and gives the thread that computes its threads (:func:`set_thread_count`) without changing that default.

torch keeps one process-wide thread count, which each thread copies the first time a library of its
(libtorch, each compiled extension) runs a parallel loop on it; ``torch.set_num_threads`` sets both that
default and the caller's own count. :func:`set_thread_count` sets the caller's own (OpenMP's and MKL's) and
leaves the default alone; the scheduler calls it before every step, so a copy of the default taken in the
middle of a step lasts at most that step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")


@functools.cache
def _runtime() -> tuple[Callable[[int], object], Callable[[int], object]] | None:
    """OpenMP's ``omp_set_num_threads`` and MKL's ``MKL_Set_Num_Threads_Local`` from the libraries this
    process has loaded (torch's own copies, found in ``/proc/self/maps``), or None where torch has no
    OpenMP runtime to reach (another platform or build: threads are then torch's business alone)."""
    loaded = _loaded_libraries()
    omp = next((p for p in loaded if Path(p).name.startswith("libgomp")), None)
    if omp is None:
        return None
    try:
        omp_set = ctypes.CDLL(omp).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    for path in (p for p in loaded if Path(p).name.startswith(("libtorch_cpu", "libmkl"))):
        try:
            # the C entry, which takes its argument by value (the lower-case name is Fortran's, by pointer)
            return (omp_set, ctypes.CDLL(path).MKL_Set_Num_Threads_Local)
        except (OSError, AttributeError):
            continue
    return (omp_set, lambda n: None)


def _loaded_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process, in load order (none off Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = [line.split()[-1] for line in lines if ".so" in line and "/" in line]
    return list(dict.fromkeys(paths))


def set_thread_count(threads: int) -> None:
    """Let the calling thread's parallel operators use ``threads`` threads, leaving the process-wide
    default (what other threads copy) as it is. Falls back to ``torch.set_num_threads`` where torch's
    OpenMP runtime cannot be reached."""
    runtime = _runtime()
    if runtime is None:
        torch.set_num_threads(threads)
        return
    omp_set, mkl_set = runtime
    torch.get_num_threads()  # libtorch's copy of the default, if this thread has none yet, taken first
    omp_set(threads)  # a Python int goes as a C int
    mkl_set(threads)


def single_threaded_default() -> None:
    """From now on every thread runs its torch operators on itself alone (the calling thread too), so
    none of them starts a pool of helper threads; a thread that computes takes its threads back with
    :func:`set_thread_count`."""
    torch.set_num_threads(1)


def on_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that ends when it returns (its helper threads end with it); its result, or
    its exception raised here."""
    out: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="kvos-setup")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return out[0]


def pin_to_first_cpu() -> None:
    """Keep the calling thread on the lowest-numbered CPU this process may use (Linux; elsewhere, or
    where the call is refused, nothing changes).

    For the scheduler's workers: they run one at a time, each passing the turn to the next by waking it,
    so they need one CPU between them. Woken on another CPU, often an idle one the kernel (or a virtual
    machine's host) has to bring back first, a worker took 145-440 us to start its turn (a 2-core Intel
    Xeon VM); on the CPU of the worker that woke it, 37 us, and the interpreter's and the sessions' code
    stays in that CPU's caches. At 8 sessions on SmolLM2-135M the turns between steps took 5.7-6.4 ms a
    step unpinned, 4.2-4.8 ms pinned (docs/benchmarks.md)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):  # refused (a sandbox, say): the thread stays where it may run
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # 0: the calling thread
