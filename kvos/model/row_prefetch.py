"""The C++ that asks for a weight's next rows while a few-row product computes the current one.

A decode step's products (one to a few activation rows) read each weight row once, from memory: a 30-layer
model's weights do not stay in any cache between steps. The kernels go row by row, loading a row's bytes
then computing on them, and the hardware prefetcher, starting afresh on every product's matrix, does not run
far enough ahead of such a loop: on an AMD Zen 5 core SmolLM2's 4-bit products streamed 16-21 GB/s with
cold caches where a copy reads 42, and ran 1.3-1.8x slower than with the same weights in cache. Asking for
the row ``ahead`` rows on (``prefetcht0``: a hint that never faults and that nothing waits for) while the
current one is computed brings them to within 5-20% of their warm-cache times (docs/benchmarks.md).

``SOURCE`` defines ``RowPrefetch``: up to three per-row arrays of a weight (its blocks; or its bytes, scales
and mins), each with its row stride in bytes, and ``operator()(r)``, which asks for row ``r + ahead`` of
each, ``ahead`` the rows that make :data:`PREFETCH_BYTES` of the first (largest) array. The few-row loops of
:mod:`kvos.model.quant_kernel` and :mod:`kvos.model.gguf_kernel` (float32 and int8 activations) call it
once per weight row; the panels (16 rows or more: a prefill, bound by its arithmetic) do not.

Where the lines go is a per-module setting (``set_prefetch_level``: 0 into L1 with ``prefetcht0``, 1 into L2
with ``prefetcht1``) chosen per CPU by :func:`machine_level`, which each kernel's loader applies: L2 on an
AMD Zen 4, L1 elsewhere. On a Zen 4 a SmolLM2 layer's four 4-bit decode products from memory took 155 us a
layer with the lines asked into L2 against 171 into L1 (one thread; 92 against 95 at two), and whole decode
steps alternated in one process ran 1.6-6.9% faster on SmolLM2 and Qwen2.5 at one and two threads
(docs/benchmarks.md, session 37); L1 was the level measured best on the Zen 5 the distance was chosen on,
and on the other CPUs kvos runs on L2 has not been measured. ``KVOS_ROW_PREFETCH=L1`` or ``L2`` overrides
the choice. The level changes no result: only where the same bytes wait.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvos.errors import ConfigError

PREFETCH_BYTES = 8192  # measured on an AMD Zen 5: 4-32 rows of 288-768 bytes ahead; best 6-9 KB
LEVELS = ("L1", "L2")  # set_prefetch_level's 0 and 1
ENV = "KVOS_ROW_PREFETCH"

SOURCE = (
    r"""
#include <atomic>

// Where RowPrefetch's lines go: 0 into L1, 1 into L2 (chosen per CPU: kvos/model/row_prefetch.py).
static std::atomic<int64_t> prefetch_level{0};

// Sets where the lines go (0: L1, 1: L2); returns the level before.
int64_t set_prefetch_level(int64_t level) {
  TORCH_CHECK(level == 0 || level == 1, "the prefetch level is 0 (L1) or 1 (L2), got ", level);
  return prefetch_level.exchange(level);
}

int64_t prefetch_level_of() { return prefetch_level.load(); }

// Asks for the cache line at p, into L2 if far, else into L1. An asm statement, not __builtin_prefetch: GCC
// 12 deletes loops whose only work is that builtin (it has no side effects), and with them every prefetch.
static inline void prefetch_line(const char* p, bool far) {
#if defined(__x86_64__) || defined(__i386__)
  if (far)
    __asm__ volatile("prefetcht1 %0" : : "m"(*p));
  else
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, far ? 2 : 3);
#endif
}

// Asks for the lines of a weight's row r + ahead (see kvos/model/row_prefetch.py) while row r is computed.
struct RowPrefetch {
  static constexpr int64_t BYTES = """
    + str(PREFETCH_BYTES)
    + r""";
  const char* base[3] = {nullptr, nullptr, nullptr};
  int64_t stride[3] = {0, 0, 0};
  int streams = 0;
  int64_t ahead = 1, rows = 0;
  bool far = prefetch_level.load(std::memory_order_relaxed) != 0;  // the level when the product began

  // rows: the weight's; then each per-row array from the largest, its base and its row stride in bytes
  explicit RowPrefetch(int64_t rows_) : rows(rows_) {}
  RowPrefetch& stream(const void* p, int64_t row_stride) {
    if (streams == 0) ahead = std::max<int64_t>(1, BYTES / std::max<int64_t>(1, row_stride));
    base[streams] = static_cast<const char*>(p);
    stride[streams++] = row_stride;
    return *this;
  }
  inline void operator()(int64_t r) const {
    const int64_t next = r + ahead;
    if (next >= rows) return;
    for (int s = 0; s < streams; ++s) {
      const char* p = base[s] + next * stride[s];
      for (int64_t o = 0; o < stride[s]; o += 64) prefetch_line(p + o, far);
      prefetch_line(p + stride[s] - 1, far);  // the last line, where the row does not start one
    }
  }
};
"""
)


def machine_level(cpuinfo: str | None = None, env: str | None = None) -> int:
    """The level for this machine (0: L1, 1: L2): ``KVOS_ROW_PREFETCH`` where set (``L1`` or ``L2``), else
    L2 on an AMD Zen 4 (family 25 with AVX-512; Zen 3, the same family, has none), else L1. ``cpuinfo``:
    the text of ``/proc/cpuinfo`` (read where None; empty where there is none); ``env``: the variable's
    value (read where None)."""
    chosen = os.environ.get(ENV, "") if env is None else env
    if chosen:
        if chosen.upper() not in LEVELS:
            raise ConfigError(f"{ENV} must be one of {', '.join(LEVELS)}, got {chosen!r}")
        return LEVELS.index(chosen.upper())
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # the first processor's fields are enough
            continue
        fields.setdefault(key.strip(), value.strip())
    zen4 = (
        fields.get("vendor_id") == "AuthenticAMD"
        and fields.get("cpu family") == "25"
        and "avx512f" in fields.get("flags", "").split()
    )
    return 1 if zen4 else 0


def apply(module: Any) -> Any:
    """``module`` (a kernel module with ``set_prefetch_level``, or None) with this machine's level set."""
    if module is not None:
        module.set_prefetch_level(machine_level())
    return module


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
