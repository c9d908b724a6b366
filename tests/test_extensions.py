"""The kernels' build: a build that was killed must not make every later start wait forever."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from kvos.extensions import build_directory
from kvos.model import dense_kernel, quant_kernel
from kvos.model.quant_kernel import kernel

NEEDS_DENSE = pytest.mark.skipif(
    dense_kernel.kernel() is None, reason="no C++ toolchain here: the dense kernel is not built"
)
LOAD = "from kvos.model.quant_kernel import kernel; import sys; sys.exit(0 if kernel() is not None else 3)"


@pytest.mark.skipif(kernel() is None, reason="no C++ toolchain here: the quantized kernel is not built")
def test_a_lock_left_by_a_killed_build_is_removed() -> None:
    """torch's ``lock`` file, as a build killed mid-way leaves it, in the quantized kernel's build
    directory: a new process loads the kernel anyway (torch alone would wait on the file for ever), says
    so, and the file is gone."""
    lock = build_directory(quant_kernel.NAME) / "lock"
    lock.write_text("")
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=600)
    finally:
        left = lock.exists()
        lock.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert not left
    assert f"left by a build of {quant_kernel.NAME} that was stopped" in done.stderr


@NEEDS_DENSE
def test_a_kernel_runs_without_the_gil() -> None:
    """While a kernel computes (one computing thread), another Python thread keeps running: it records
    times all through the middle half of the call. A kernel holding the GIL would leave that span empty."""
    mod = dense_kernel.kernel()
    x, w = torch.randn(512, 4096), torch.randn(4096, 4096)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        began = time.perf_counter()
        mod.mm(x, w, torch.empty(0))
        ended = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
        torch.set_num_threads(threads)
    quarter = (ended - began) / 4
    inside = [t for t in ticks if began + quarter < t < ended - quarter]
    assert len(inside) > 0


@NEEDS_DENSE
def test_a_kernels_error_is_still_a_python_exception() -> None:
    """A failed check inside a kernel (run without the GIL) comes back as a RuntimeError naming it."""
    mod = dense_kernel.kernel()
    with pytest.raises(RuntimeError, match="float32 only"):
        mod.mm(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64), torch.empty(0))
