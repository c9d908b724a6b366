"""C++ extensions compiled on first use (``torch.utils.cpp_extension.load_inline``; the build is cached).

Every kvos kernel has a torch fallback with the same results, so a missing compiler or
``KVOS_NO_EXTENSIONS=1`` costs speed, never correctness: :func:`build` then returns None (with a warning
saying why, when it failed).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any


def build(
    name: str, source: str, functions: Sequence[str], cflags: Sequence[str], fallback: str
) -> Any | None:
    """The compiled module ``name`` exporting ``functions`` from C++ ``source`` (OpenMP on), or None;
    ``fallback`` names what runs instead, for the warning."""
    if os.environ.get("KVOS_NO_EXTENSIONS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=name,
            cpp_sources=[source],
            functions=list(functions),
            # -fopenmp: at::parallel_for is inline OpenMP, serial without it (torch's libgomp is reused)
            extra_cflags=[*cflags, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, headers missing: the torch path still works
        warnings.warn(f"kvos: {name} kernel unavailable, using {fallback} ({exc})", stacklevel=3)
        return None
