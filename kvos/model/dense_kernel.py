"""A CPU kernel for float32 projections of a few activation rows (decode steps, batched or not).

``mm(x, w, c)`` computes ``c + x @ w.T`` for x float32 [n, K] and a dense weight w float32 [N, K] (torch's own
[out, in] layout, rows contiguous), c float32 [n, N], [N] (a bias) or empty. Each weight row is read from
memory once for all of x's rows: tiles of 4 activation rows by 3 weight rows keep 12 running sums in AVX2
registers, and a block of 15 weight rows stays in cache while every group of 4 activation rows passes over it;
the last pass over a block prefetches the next one, so with more than 4 rows the weights stream in from memory
while the other passes compute (8 rows: 10-18% less time than without, measured on the 0.5B shape).
A decode step is bound by reading the weights, so 8 sequences in one step cost about 2x one sequence here,
where the float32 BLAS on a 2-core CPU (MKL) costs 4-6x for 8 rows (docs/benchmarks.md). Rows beyond
:data:`SMALL_N` (prefill) go to torch's matmul. Portable loops replace the intrinsics on a CPU without
AVX2/FMA. Compiled on first use (:func:`kvos.extensions.build`); without it torch computes the same products.
"""

from __future__ import annotations

import functools
from typing import Any

from kvos.extensions import build

SMALL_N = 32  # the most activation rows the kernel takes: above it the BLAS is as fast (measured)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVOS_AVX2 1
#endif

constexpr int64_t ROWS = 4;    // activation rows per tile
constexpr int64_t COLS = 3;    // weight rows per tile
constexpr int64_t BLOCK = 15;  // weight rows kept in cache while every activation row passes (COLS | BLOCK)

// One output: x[0:K] . w[0:K], from k on (the tail the vector loop left).
static inline float dot_from(const float* x, const float* w, int64_t k, int64_t K, float acc) {
  for (; k < K; ++k) acc += x[k] * w[k];
  return acc;
}

#if KVOS_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// o[j * N + c] = x_j . w_c for R activation rows (stride K) and C weight rows (stride K).
template <int R, int C>
static inline void tile(const float* x, const float* w, int64_t K, float* o, int64_t N,
                        int64_t ahead = 0) {
  __m256 acc[R][C];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (ahead && (k & 15) == 0)
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + ahead + c * K + k), _MM_HINT_T0);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int j = 0; j < R; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
      for (int c = 0; c < C; ++c) acc[j][c] = _mm256_fmadd_ps(wv[c], xv, acc[j][c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) o[j * N + c] = dot_from(x + j * K, w + c * K, k, K, hsum(acc[j][c]));
}
#else
template <int R, int C>
static inline void tile(const float* x, const float* w, int64_t K, float* o, int64_t N,
                        int64_t ahead = 0) {
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) o[j * N + c] = dot_from(x + j * K, w + c * K, 0, K, 0.0f);
}
#endif

// Outputs [i0, i1) of R activation rows (stride K) starting at x, into o (row stride N).
template <int R>
static void rows_of(const float* x, int64_t K, const float* w, float* o, int64_t N, int64_t i0, int64_t i1,
                    int64_t ahead) {
  int64_t i = i0;
  for (; i + COLS <= i1; i += COLS) tile<R, COLS>(x, w + i * K, K, o + i, N, ahead);
  for (; i < i1; ++i) tile<R, 1>(x, w + i * K, K, o + i, N, ahead);
}

// Outputs [i0, i1) of every activation row, a block of weight rows at a time.
static void rows(const float* x, int64_t n, int64_t K, const float* w, float* o, int64_t N, int64_t i0,
                 int64_t i1) {
  for (int64_t b0 = i0; b0 < i1; b0 += BLOCK) {
    const int64_t b1 = std::min(i1, b0 + BLOCK);
    for (int64_t j = 0; j < n; j += ROWS) {
      const float* xj = x + j * K;
      float* oj = o + j * N;
      // the last pass over this block brings the next block's rows in: the memory is read while the
      // other passes compute, not after them
      const int64_t ahead = (j + ROWS >= n && b1 + BLOCK <= i1) ? BLOCK * K : 0;
      switch (std::min(ROWS, n - j)) {
        case 1: rows_of<1>(xj, K, w, oj, N, b0, b1, ahead); break;
        case 2: rows_of<2>(xj, K, w, oj, N, b0, b1, ahead); break;
        case 3: rows_of<3>(xj, K, w, oj, N, b0, b1, ahead); break;
        default: rows_of<ROWS>(xj, K, w, oj, N, b0, b1, ahead); break;
      }
    }
  }
}

// c + x [n, K] @ w [N, K]^T -> [n, N]; c: [n, N], [N] or empty (nothing added).
torch::Tensor mm(torch::Tensor x, torch::Tensor w, torch::Tensor c) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.dim() == 2, "contiguous 2-D");
  const int64_t n = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
  auto out = torch::empty({n, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t p0, int64_t p1) {
    rows(xp, n, K, wp, op, N, p0 * BLOCK, std::min(N, p1 * BLOCK));
  });
  if (c.numel() > 0) out.add_(c);
  return out;
}
"""


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    return build("kvos_dense_v3", _SOURCE, ["mm"], ["-O3", "-march=native"], "torch's matmul")
