"""The kernels' build: a build that was killed must not make every later start wait forever."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvos.extensions import build_directory
from kvos.model import quant_kernel
from kvos.model.quant_kernel import kernel

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
