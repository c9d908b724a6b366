"""Tests force each build of a compiled kernel (this CPU's, AVX2 only, portable), so that a path the test
machine would not pick is still tested."""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import kvos


def forced(builds: Mapping[str, Callable[[], Any]], name: str, kernel: str) -> Any:
    """The ``name`` build of ``kernel`` (e.g. "the decode kernel"), or the test skipped saying it could not
    be made here (no compiler, or extensions disabled)."""
    module = builds[name]()
    if module is None:
        pytest.skip(f"{kernel}'s {name} build could not be made here")
    return module


def builders(source: str) -> list[str]:
    """The module-level functions of a module's ``source`` that compile a kernel: ``kernel`` (the module's
    own) and ``*_kernel`` (the forced builds such as ``avx2_kernel`` and ``portable_kernel``) that call
    :func:`kvos.extensions.build`."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and (node.name == "kernel" or node.name.endswith("_kernel")):
            calls = (n for n in ast.walk(node) if isinstance(n, ast.Call))
            if any(isinstance(c.func, ast.Name) and c.func.id == "build" for c in calls):
                found.append(node.name)
    return found


def kernel_modules() -> dict[str, list[str]]:
    """Every kvos module that compiles a kernel, with its functions that do (:func:`builders`)."""
    found = {}
    for info in pkgutil.walk_packages(kvos.__path__, "kvos."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        names = builders(Path(spec.origin).read_text())
        if names:
            found[info.name] = names
    return found
