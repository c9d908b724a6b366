"""``kvos serve`` compiles every kernel before it listens (:func:`kvos.server.main.prepare_kernels`): one
left out is compiled inside the first request that reaches it, which then waits ~20 s on a fresh machine
(the decode step's loop was, until it was listed)."""

from __future__ import annotations

import importlib
import re

import pytest
from kernel_builds import kernel_modules

from kvos.server.main import DELTA_KERNEL, KERNELS, prepare_kernels


def test_every_kernel_of_the_package_is_prepared() -> None:
    modules = sorted(name for name, fns in kernel_modules().items() if "kernel" in fns)
    # the kernels known when this test was written: the walk finds them (so it cannot pass by finding none)
    assert {"kvos.engine.fused", "kvos.model.step_kernel", "kvos.model.quant_kernel"} <= set(modules)
    prepared = {load for _, load, _ in (*KERNELS, DELTA_KERNEL)}
    missing = [m for m in modules if importlib.import_module(m).kernel not in prepared]
    assert missing == []


def test_serve_start_says_the_decode_step_is_ready(capsys: pytest.CaptureFixture[str]) -> None:
    prepare_kernels()
    err = capsys.readouterr().err
    names = [name for name, _, _ in KERNELS]
    for name in names:
        assert re.search(rf"\[kvos\] {name} kernel (ready|unavailable)", err), name
    assert "delta-net" not in err  # only for a model with delta nets
