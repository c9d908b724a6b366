"""``kvos serve`` compiles every kernel before it listens (:func:`kvos.server.main.prepare_kernels`): one
left out is compiled inside the first request that reaches it, which then waits ~20 s on a fresh machine
(the decode step's loop was, until it was listed)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import pytest

import kvos
from kvos.server.main import DELTA_KERNEL, KERNELS, prepare_kernels


def _builds_its_kernel(source: str) -> bool:
    """A module's own kernel: a module-level ``kernel()`` that calls :func:`kvos.extensions.build` (the
    forced builds the tests use, ``portable_kernel()``, ``avx2_kernel()``, are other functions)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "kernel":
            calls = (n for n in ast.walk(node) if isinstance(n, ast.Call))
            return any(isinstance(c.func, ast.Name) and c.func.id == "build" for c in calls)
    return False


def _modules_with_a_kernel() -> list[str]:
    found = []
    for info in pkgutil.walk_packages(kvos.__path__, "kvos."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        if _builds_its_kernel(Path(spec.origin).read_text()):
            found.append(info.name)
    return sorted(found)


def test_every_kernel_of_the_package_is_prepared() -> None:
    modules = _modules_with_a_kernel()
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
