"""Tests force each build of a compiled kernel (this CPU's, AVX2 only, portable), so that a path the test
machine would not pick is still tested."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest


def forced(builds: Mapping[str, Callable[[], Any]], name: str, kernel: str) -> Any:
    """The ``name`` build of ``kernel`` (e.g. "the decode kernel"), or the test skipped saying it could not
    be made here (no compiler, or extensions disabled)."""
    module = builds[name]()
    if module is None:
        pytest.skip(f"{kernel}'s {name} build could not be made here")
    return module
