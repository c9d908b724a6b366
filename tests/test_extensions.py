"""The kernels' build: a build that was killed must not make every later start wait forever; a target other
than this CPU (``KVOS_MARCH``) is what the compiler builds for, cached beside the native build."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from kvos import extensions
from kvos.errors import ConfigError
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
    name, _ = extensions.targeted(quant_kernel.NAME, ["-march=native"])  # the build KVOS_MARCH names, if set
    lock = build_directory(name) / "lock"
    lock.write_text("")
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=600)
    finally:
        left = lock.exists()
        lock.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert not left
    assert f"left by a build of {name} that was stopped" in done.stderr


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


def test_a_named_target_replaces_native_in_the_flags_and_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVOS_MARCH=znver3``: every build for this CPU is built for Zen 3 instead, under a name of its own;
    the portable builds (no -march) stay as they are; unset, nothing changes."""
    native = ["-O3", "-march=native", "-mno-avx512f"]
    monkeypatch.delenv(extensions.MARCH_ENV, raising=False)
    assert extensions.targeted("kvos_quant_v9", native) == ("kvos_quant_v9", native)
    monkeypatch.setenv(extensions.MARCH_ENV, "znver3")
    assert extensions.targeted("kvos_quant_v9", native) == (
        "kvos_quant_v9__znver3",
        ["-O3", "-march=znver3", "-mno-avx512f"],
    )
    portable = ["-O3", "-DKVOS_PORTABLE"]
    assert extensions.targeted("kvos_quant_portable_v9", portable) == ("kvos_quant_portable_v9", portable)
    monkeypatch.setenv(extensions.MARCH_ENV, "x86-64-v3")
    assert extensions.targeted("kvos_decode_v17", ["-march=native"]) == (
        "kvos_decode_v17__x86_64_v3",
        ["-march=x86-64-v3"],
    )


@pytest.mark.parametrize("value", ["native -mavx512f", "znver3;id", "ZNVER3", "-O0", "a" * 41])
def test_a_target_gcc_could_not_take_is_a_config_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """What is not a plain -march name (a second flag, a shell's separator, capitals, a leading dash) is
    refused before any build, naming the variable."""
    monkeypatch.setenv(extensions.MARCH_ENV, value)
    with pytest.raises(ConfigError, match="KVOS_MARCH"):
        extensions.march()
    with pytest.raises(ConfigError, match="KVOS_MARCH"):
        extensions.build("kvos_probe", "", [], ["-march=native"], "nothing")


PROBE = """
#include <torch/extension.h>
// 1 where the compiler was told the target has AVX2, AVX-512F, AVX-VNNI: what the kernels' #if choose by
int64_t features() {
  int64_t f = 0;
#ifdef __AVX2__
  f |= 1;
#endif
#ifdef __AVX512F__
  f |= 2;
#endif
#ifdef __AVXVNNI__
  f |= 4;
#endif
  return f;
}
"""


@pytest.mark.skipif(kernel() is None, reason="no C++ toolchain here: no kernel is built")
def test_a_build_for_zen_3_has_avx2_and_nothing_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with ``KVOS_MARCH=znver3``, a kernel sees AVX2 and neither AVX-512 nor AVX-VNNI, whatever this
    CPU has: the path a Zen 3 takes (built for this CPU, an AVX-512 machine would take its own)."""
    monkeypatch.setenv(extensions.MARCH_ENV, "znver3")
    probe = extensions.build("kvos_march_probe_v1", PROBE, ["features"], ["-O1", "-march=native"], "nothing")
    assert probe is not None
    assert probe.features() == 1
    assert build_directory("kvos_march_probe_v1__znver3").is_dir()
