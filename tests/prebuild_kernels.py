"""Compile every build of every kvos kernel before the suite runs (CI's step after installing): this CPU's
builds, which ``kvos serve`` prepares at start-up, and the builds the tests force (AVX2 only, portable,
without VBMI), one per core at a time. Each build is one compiler process on one core, ~30 s, and the tests
would compile them one after another, the other core idle (~20 builds: ~10 minutes of a 2-core CI).

Run as ``python tests/prebuild_kernels.py``; prints each build's result and exits non-zero if one failed
to build where this CPU's own build of that kernel did build (a compiler that works, a source that does not).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kernel_builds import kernel_modules


def build(module: str, function: str) -> tuple[str, bool, float]:
    """Build ``module.function()``; (its name, whether it built, seconds)."""
    began = time.perf_counter()
    built = getattr(importlib.import_module(module), function)() is not None
    return f"{module}.{function}", built, time.perf_counter() - began


def main() -> int:
    jobs = [(module, fn) for module, fns in sorted(kernel_modules().items()) for fn in fns]
    began = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(build, *zip(*jobs, strict=True)))
    native = {name.rsplit(".", 1)[0] for name, built, _ in results if name.endswith(".kernel") and built}
    failed = []
    for name, built, seconds in results:
        print(f"[prebuild] {name}: {'built' if built else 'unavailable'} ({seconds:.1f} s)")
        if not built and name.rsplit(".", 1)[0] in native:
            failed.append(name)
    seconds = time.perf_counter() - began
    print(f"[prebuild] {len(results)} builds in {seconds:.0f} s on {os.cpu_count()} cores")
    if failed:
        print(f"[prebuild] failed where this CPU's own build works: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
