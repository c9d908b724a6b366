"""C++ extensions compiled on first use (``torch.utils.cpp_extension.load_inline``; the build is cached).

Every kvos kernel has a torch fallback with the same results, so a missing compiler or
``KVOS_NO_EXTENSIONS=1`` costs speed, never correctness: :func:`build` then returns None (with a warning
saying why, when it failed).

Every exported function runs with the GIL released (``torch::wrap_pybind_function_no_gil``; their
arguments and results are tensors and numbers, never Python objects), as torch's own operators do: while a
forward pass's products run in the scheduler's thread, the sessions' threads and the server's event loop
go on with their Python (sampling, streaming, bookkeeping) instead of waiting for the kernel to return.

Builds of one kernel are serialised across processes by an advisory lock (``kvos.flock`` in its build
directory) that the operating system releases when its holder dies. torch's own build lock (a ``lock``
file it deletes when done) outlives a build that was killed, and every later load then waits on it
forever; holding the advisory lock, kvos knows such a file is stale (no live kvos process is building)
and removes it.

The kernels are built for this CPU (``-march=native``). ``KVOS_MARCH`` names another target for gcc's
``-march`` (``znver3``: an AMD Zen 3's AVX2 without AVX-512 or AVX-VNNI; ``x86-64-v3``; ``icelake-server``):
a machine with more features then runs the path a CPU of that target would, for figures and checks of that
path on the whole model. Such builds carry the target in their name, so they are cached beside the native
ones, not in their place.
"""

from __future__ import annotations

import fcntl
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvos.errors import ConfigError

MARCH_ENV = "KVOS_MARCH"
_MARCH = re.compile(r"[a-z0-9][a-z0-9.+-]{0,39}")


def build(
    name: str, source: str, functions: Sequence[str], cflags: Sequence[str], fallback: str
) -> Any | None:
    """The compiled module ``name`` exporting ``functions`` from C++ ``source`` (OpenMP on), or None;
    ``fallback`` names what runs instead, for the warning."""
    if os.environ.get("KVOS_NO_EXTENSIONS") == "1":
        return None
    name, cflags = targeted(name, cflags)
    try:
        from torch.utils.cpp_extension import load_inline

        with _build_lock(name):
            return load_inline(
                name=name,
                cpp_sources=[source + bindings(functions)],
                # -fopenmp: at::parallel_for is inline OpenMP, serial without it (torch's libgomp is reused)
                extra_cflags=[*cflags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, headers missing: the torch path still works
        warnings.warn(f"kvos: {name} kernel unavailable, using {fallback} ({exc})", stacklevel=3)
        return None


def march() -> str | None:
    """The ``-march`` target that ``KVOS_MARCH`` names, or None (unset or empty: this CPU's own); a name gcc
    could not take (letters, digits, ``.+-``) is a :class:`~kvos.errors.ConfigError`."""
    value = os.environ.get(MARCH_ENV, "").strip()
    if not value:
        return None
    if not _MARCH.fullmatch(value):
        raise ConfigError(f"{MARCH_ENV} must name a gcc -march target such as znver3, got {value!r}")
    return value


def targeted(name: str, cflags: Sequence[str]) -> tuple[str, list[str]]:
    """``name`` and ``cflags`` for the target :func:`march` names: ``-march=native`` becomes that target
    and the name gains it (``kvos_quant_v9`` -> ``kvos_quant_v9__znver3``); unchanged where none is set or
    the flags do not build for this CPU (the portable builds)."""
    target = march()
    if target is None or "-march=native" not in cflags:
        return name, list(cflags)
    flags = [f"-march={target}" if flag == "-march=native" else flag for flag in cflags]
    return f"{name}__{re.sub(r'[^a-z0-9]', '_', target)}", flags


def bindings(functions: Sequence[str]) -> str:
    """The pybind11 module of ``functions``, each wrapped to turn C++ errors into Python ones and to run
    without the GIL."""
    lines = [f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");' for f in functions]
    return "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + "\n".join(lines) + "\n}\n"


def build_directory(name: str) -> Path:
    """Where torch builds and caches extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default; made if
    missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold ``name``'s advisory build lock; remove torch's ``lock`` file if one is left behind (see the
    module docstring)."""
    directory = build_directory(name)
    with open(directory / "kvos.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                warnings.warn(
                    f"kvos: removed {stale}, left by a build of {name} that was stopped", stacklevel=4
                )
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
