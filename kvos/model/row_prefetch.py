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
"""

PREFETCH_BYTES = 8192  # measured on an AMD Zen 5: 4-32 rows of 288-768 bytes ahead; best 6-9 KB

SOURCE = (
    r"""
// Asks for the cache line at p. An asm statement, not __builtin_prefetch: GCC 12 deletes loops whose only
// work is that builtin (it has no side effects), and with them every prefetch below.
static inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
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
      for (int64_t o = 0; o < stride[s]; o += 64) prefetch_line(p + o);
      prefetch_line(p + stride[s] - 1);  // the last line, where the row does not start one
    }
  }
};
"""
)
