"""What every benchmark shares: the JSON contract, medians, side-by-side timing, a printed table."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvos.extensions import march


def header(benchmark: str, model: str, device: str = "cpu") -> dict[str, Any]:
    """The top-level fields every benchmark JSON carries (DESIGN.md, benchmark contracts)."""
    return {
        "benchmark": benchmark,
        "model": model,
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "simd": simd_flags(),
        "march": march() or "native",  # the target kvos's kernels were built for (KVOS_MARCH)
    }


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``; elsewhere what :mod:`platform` says): kernels rank
    differently on each kind of CPU, so every figure carries it."""
    for line in _read(cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def simd_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of :data:`SIMD_FLAGS` the CPU has (empty where ``/proc/cpuinfo`` is not there to say)."""
    for line in _read(cpuinfo).splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [f for f in SIMD_FLAGS if f in present]
    return []


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class CacheFlush:
    """Call before a timed operation to start it with cold CPU caches: rewrites a buffer larger than any
    last-level cache (64 MiB by default), evicting whatever the previous operation left there."""

    def __init__(self, nbytes: int = 64 << 20) -> None:
        self.buffer = torch.zeros(nbytes // 4)

    def __call__(self) -> None:
        self.buffer.add_(1.0)


def alternate(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Time several contenders side by side: each repeat runs every contender once, in turn,
    so drift in machine load hits them alike. Returns seconds per contender per repeat."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn)[0])
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """A Markdown table of the chosen columns."""

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |")


def write_json(path: str | Path | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
