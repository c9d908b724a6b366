"""A CPU kernel for float32 projections: a few activation rows (decode steps, batched or not), prefill slices.

``mm(x, w, c)`` and ``gemm(x, w, c)`` compute ``c + x @ w.T`` for x float32 [n, K] and a dense weight w
float32 [N, K] (torch's own [out, in] layout, rows contiguous), c float32 [n, N], [N] (a bias) or empty.

``mm``, for a few rows: each weight row is read from memory once for all of x's rows: tiles of 4 activation
rows by 6 weight rows keep 24 running sums in 512-bit registers (AVX-512; 4 by 3 in 256-bit ones on an AVX2
CPU), and a block of about 64 KB of weight rows stays in cache while every group of 4 activation rows passes
over it. Each pass over a block asks for its share of the next block's columns, so with more than 4 rows the
weights stream in from memory while the passes compute. An 8-row step's products over Qwen2.5-0.5B's shape:
59 ms where 4 x 3 AVX2 tiles prefetching in the last pass only took 70 (one row: 49-53), two threads of an
AMD EPYC Zen 5 (docs/benchmarks.md).

``gemm``, for many rows: x is packed in panels of 32 rows (16 on AVX2), transposed, and a tile keeps 12
weight rows by a panel's 32 tokens of running sums (6 by 16), one token a lane: each column k costs two
vector loads and 12 broadcasts for 24 multiply-adds, where the dot-product tiles of ``mm`` load 10 vectors,
so the products run from cache at 210-250 G multiply-adds a second on that machine's two cores (``mm``:
125-165, torch's BLAS 80-110).

The kernel takes up to :data:`SMALL_N` rows, and prefill slices by the path :func:`prefill_path` measured
fastest here (the panels from :data:`GEMM_N` rows, the tiles :data:`CHUNK_N` rows at a time, or torch's
matmul). Portable loops replace the intrinsics on a CPU without AVX2/FMA. Compiled on first use
(:func:`kvos.extensions.build`); without it torch computes the same products. The weights should start on a
cache line (:func:`kvos.model.linear.cache_aligned`): 512-bit loads across two lines made 8 rows over a
151,936-row head 1.3x slower.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.nn.functional as F

from kvos.extensions import build
from kvos.model.simd_vec import SOURCE as SIMD_VEC

SMALL_N = 32  # the kernel always takes up to this many activation rows: faster than the BLAS on every CPU
GEMM_N = 64  # from this many rows the kernel's panels take a product, where they are the prefill path here
CHUNK_N = 256  # the tiles take more rows this many at a time (a prefill, where they are the path here)
PROBE_ROWS, PROBE_IN, PROBE_OUT = 128, 896, 2304  # the measurement: a prefill slice of a 0.5B model's shape

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX2 1
#endif
"""
    + SIMD_VEC
    + r"""
constexpr int64_t ROWS = 4;  // activation rows per tile
#if KVOS_AVX512
constexpr int64_t COLS = 6;  // weight rows per tile: 24 running sums of 32 registers
#else
constexpr int64_t COLS = 3;  // weight rows per tile: 12 running sums of 16 registers
#endif
constexpr int64_t BLOCK_BYTES = 64 * 1024;  // weight rows kept in cache while every activation row passes

// The weight rows of a block: about BLOCK_BYTES of them, a whole number of tiles.
static inline int64_t block_rows(int64_t K) {
  return std::max<int64_t>(1, BLOCK_BYTES / (4 * K * COLS)) * COLS;
}

// Which weights a tile asks for ahead: those `ahead` floats further on, columns [k0, k1) of its rows.
struct Ahead {
  int64_t ahead = 0, k0 = 0, k1 = 0;
};

// One output: x[0:K] . w[0:K], from k on (the tail the vector loop left).
static inline float dot_from(const float* x, const float* w, int64_t k, int64_t K, float acc) {
  for (; k < K; ++k) acc += x[k] * w[k];
  return acc;
}

#if KVOS_AVX512 || KVOS_AVX2

// o[j * N + c] = x_j . w_c for R activation rows (stride K) and C weight rows (stride K), asking for the
// weights `pre` names a cache line at a time.
template <int R, int C>
static inline void tile(const float* x, const float* w, int64_t K, float* o, int64_t N, Ahead pre) {
  Vec acc[R][C];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = vzero();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    if (pre.ahead && (k & 15) == 0 && k >= pre.k0 && k < pre.k1)
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + pre.ahead + c * K + k), _MM_HINT_T0);
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(w + c * K + k);
    for (int j = 0; j < R; ++j) {
      const Vec xv = vload(x + j * K + k);
      for (int c = 0; c < C; ++c) acc[j][c] = vfma(wv[c], xv, acc[j][c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) o[j * N + c] = dot_from(x + j * K, w + c * K, k, K, hsum(acc[j][c]));
}
#else
template <int R, int C>
static inline void tile(const float* x, const float* w, int64_t K, float* o, int64_t N, Ahead) {
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < C; ++c) o[j * N + c] = dot_from(x + j * K, w + c * K, 0, K, 0.0f);
}
#endif

// Outputs [i0, i1) of R activation rows (stride K) starting at x, into o (row stride N).
template <int R>
static void rows_of(const float* x, int64_t K, const float* w, float* o, int64_t N, int64_t i0, int64_t i1,
                    Ahead pre) {
  int64_t i = i0;
  for (; i + COLS <= i1; i += COLS) tile<R, COLS>(x, w + i * K, K, o + i, N, pre);
  for (; i < i1; ++i) tile<R, 1>(x, w + i * K, K, o + i, N, pre);
}

// Outputs [i0, i1) of every activation row, a block of weight rows at a time.
static void rows(const float* x, int64_t n, int64_t K, const float* w, float* o, int64_t N, int64_t i0,
                 int64_t i1) {
  const int64_t BLOCK = block_rows(K), passes = (n + ROWS - 1) / ROWS;
  for (int64_t b0 = i0; b0 < i1; b0 += BLOCK) {
    const int64_t b1 = std::min(i1, b0 + BLOCK);
    for (int64_t j = 0; j < n; j += ROWS) {
      const float* xj = x + j * K;
      float* oj = o + j * N;
      // each pass over this block brings in its share of the next block's columns: the memory is read
      // all the time the passes compute
      const int64_t p = j / ROWS;
      Ahead pre;
      if (b1 + BLOCK <= i1) pre = {BLOCK * K, K * p / passes / 16 * 16, K * (p + 1) / passes / 16 * 16};
      if (p + 1 == passes) pre.k1 = K;
      switch (std::min(ROWS, n - j)) {
        case 1: rows_of<1>(xj, K, w, oj, N, b0, b1, pre); break;
        case 2: rows_of<2>(xj, K, w, oj, N, b0, b1, pre); break;
        case 3: rows_of<3>(xj, K, w, oj, N, b0, b1, pre); break;
        default: rows_of<ROWS>(xj, K, w, oj, N, b0, b1, pre); break;
      }
    }
  }
}

// x [n, K] and w [N, K], both float32 and contiguous, or a RuntimeError saying which is not.
static void check_operands(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.dim() == 2, "contiguous 2-D");
  TORCH_CHECK(w.size(1) == x.size(1), "x and w disagree on K");
}

// Many activation rows (a prefill): x's rows packed in panels of TOKENS, transposed, so that a tile keeps
// WROWS weight rows by TOKENS tokens of running sums, each sum a lane: per column k, TOKENS / LANES loads of
// the panel and WROWS broadcasts of weights feed WROWS * TOKENS / LANES multiply-adds. A few bytes a
// multiply-add come from cache where the dot-product tiles above read two vectors for each four.
#if KVOS_AVX512
constexpr int64_t TOKENS = 32, WROWS = 12;  // 24 running sums of 32 registers
#elif KVOS_AVX2
constexpr int64_t TOKENS = 16, WROWS = 6;  // 12 running sums of 16 registers
#endif

#if KVOS_AVX512 || KVOS_AVX2
constexpr int64_t GROUP = 4;  // tiles whose weight rows stay in cache while every panel passes them
constexpr int64_t PACKED_BYTES = 8 << 20;  // the packed rows every group of tiles streams, at most
// Each sum runs over this many columns in a register, then adds to the sum so far (as a BLAS's blocks do):
// float32 rounding grows with the terms of one running sum, and a chain of all 1,536 of SmolLM2's down
// projection took its logits 1.5e-4 from exact float64 ones, where the tiles' sixteen chains a sum kept 1e-4.
constexpr int64_t KBLOCK = 64;

// The rows packed at a time: a whole number of panels, about PACKED_BYTES of them (2,048 rows of 4,864
// values at once: 163 G multiply-adds a second, 416 at a time: 215).
static inline int64_t chunk_rows(int64_t K) {
  return std::max<int64_t>(1, PACKED_BYTES / (4 * K * TOKENS)) * TOKENS;
}

// xp [panels][K][TOKENS]: x's rows [n, K] transposed TOKENS at a time, zeros past row n.
static void pack(const float* x, int64_t n, int64_t K, float* xp) {
  const int64_t panels = (n + TOKENS - 1) / TOKENS;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = xp + p * K * TOKENS;
      for (int64_t t = 0; t < TOKENS; ++t) {
        const int64_t row = p * TOKENS + t;
        if (row < n) {
          const float* src = x + row * K;
          for (int64_t k = 0; k < K; ++k) dst[k * TOKENS + t] = src[k];
        } else {
          for (int64_t k = 0; k < K; ++k) dst[k * TOKENS + t] = 0.0f;
        }
      }
    }
  });
}

// o[t * N + r] = w_r . x_t for R weight rows (stride K) and a panel's first `tokens` tokens.
template <int R>
static inline void panel_tile(const float* w, int64_t K, const float* panel, float* o, int64_t N,
                              int64_t tokens) {
  constexpr int64_t V = TOKENS / LANES;
  alignas(64) float sums[R][TOKENS];
  for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
    Vec acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = vzero();
    for (int64_t k = k0, k1 = std::min(K, k0 + KBLOCK); k < k1; ++k) {
      Vec xv[V];
      for (int v = 0; v < V; ++v) xv[v] = vload(panel + k * TOKENS + v * LANES);
      for (int r = 0; r < R; ++r) {
        const Vec b = vbroadcast(w + r * K + k);
        for (int v = 0; v < V; ++v) acc[r][v] = vfma(b, xv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        float* at = &sums[r][v * LANES];
        vstore(at, k0 == 0 ? acc[r][v] : vadd(vload(at), acc[r][v]));
      }
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int r = 0; r < R; ++r) o[t * N + r] = sums[r][t];
}

// c + x [n, K] @ w [N, K]^T -> [n, N] by panels (any n; made for more than about 64 rows).
torch::Tensor gemm(torch::Tensor x, torch::Tensor w, torch::Tensor c) {
  check_operands(x, w);
  const int64_t n = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({n, N}, x.options());
  const int64_t chunk = chunk_rows(K), panels_most = (std::min(n, chunk) + TOKENS - 1) / TOKENS;
  auto packed = torch::empty({panels_most * K * TOKENS}, x.options());
  float* xp = packed.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t rows_a_group = GROUP * WROWS, groups = (N + rows_a_group - 1) / rows_a_group;
  for (int64_t i0 = 0; i0 < n; i0 += chunk) {
    const int64_t m = std::min(chunk, n - i0), panels = (m + TOKENS - 1) / TOKENS;
    pack(x.data_ptr<float>() + i0 * K, m, K, xp);
    float* op = out.data_ptr<float>() + i0 * N;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t r0 = g * rows_a_group, r1 = std::min(N, r0 + rows_a_group);
        for (int64_t p = 0; p < panels; ++p) {
          const float* panel = xp + p * K * TOKENS;
          const int64_t tokens = std::min(TOKENS, m - p * TOKENS);
          float* o = op + p * TOKENS * N;
          int64_t r = r0;
          for (; r + WROWS <= r1; r += WROWS) panel_tile<WROWS>(wp + r * K, K, panel, o + r, N, tokens);
          for (; r < r1; ++r) panel_tile<1>(wp + r * K, K, panel, o + r, N, tokens);
        }
      }
    });
  }
  if (c.numel() > 0) out.add_(c);
  return out;
}
#endif

// c + x [n, K] @ w [N, K]^T -> [n, N]; c: [n, N], [N] or empty (nothing added).
torch::Tensor mm(torch::Tensor x, torch::Tensor w, torch::Tensor c) {
  check_operands(x, w);
  const int64_t n = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({n, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t BLOCK = block_rows(K), blocks = (N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t p0, int64_t p1) {
    rows(xp, n, K, wp, op, N, p0 * BLOCK, std::min(N, p1 * BLOCK));
  });
  if (c.numel() > 0) out.add_(c);
  return out;
}

#if !(KVOS_AVX512 || KVOS_AVX2)
// Without SIMD the panels gain nothing: the same loops as mm.
torch::Tensor gemm(torch::Tensor x, torch::Tensor w, torch::Tensor c) { return mm(x, w, c); }
#endif
"""
)


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    return build("kvos_dense_v6", _SOURCE, ["mm", "gemm"], ["-O3", "-march=native"], "torch's matmul")


PATHS = {
    "panels": "the dense kernel's panels",
    "tiles": "the dense kernel's tiles",
    "blas": "torch's matmul",
}  # how products of more than SMALL_N rows can run, as kvos serve's start-up names them


def takes(n: int) -> bool:
    """Whether a product of ``n`` float32 activation rows goes to the kernel (else torch's matmul)."""
    return n <= SMALL_N or prefill_path() != "blas"


@functools.cache
def prefill_path() -> str:
    """How products of more than :data:`SMALL_N` rows (prefill slices) run here, one of :data:`PATHS`:
    the fastest on a probe measured once a process (:func:`fastest_prefill`). On an AMD EPYC (Zen 5,
    AVX-512, two threads) the panels run 2.0-2.5x torch's BLAS (its AVX2 code on an AMD CPU) and 1.4-1.7x
    the tiles from 64 rows (docs/benchmarks.md)."""
    module = kernel()
    return "blas" if module is None else fastest_prefill(module)


def product(module: Any, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """c + x @ w.T on the kernel ``module`` (c [n, N], [N] or empty): :data:`GEMM_N` rows or more by its
    panels where those are this machine's prefill path, else by its tiles, :data:`CHUNK_N` rows at a time
    (c [n, N] cut alike): a chunk's activations stay in cache while a block of weight rows passes them,
    where 1,024 rows of 4,864 values would not (68 against 127 G multiply-adds a second)."""
    n = x.shape[0]
    if n >= GEMM_N and prefill_path() == "panels":
        return module.gemm(x, w, c)
    if n <= CHUNK_N:
        return module.mm(x, w, c)
    rows = c.dim() == 2
    return torch.cat(
        [module.mm(x[i : i + CHUNK_N], w, c[i : i + CHUNK_N] if rows else c) for i in range(0, n, CHUNK_N)]
    )


def fastest_prefill(module: Any) -> str:
    """Which of :data:`PATHS` multiplied [PROBE_ROWS, PROBE_IN] @ [PROBE_OUT, PROBE_IN].T the fastest (best
    of five each, alternated, weights and activations warm); a path of the kernel only where it took at
    most 0.9x torch's time (a tie goes to the library)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(PROBE_ROWS, PROBE_IN, generator=g), torch.randn(PROBE_OUT, PROBE_IN, generator=g)
    empty = torch.empty(0)
    runs = {
        "panels": lambda: module.gemm(x, w, empty),
        "tiles": lambda: module.mm(x, w, empty),
        "blas": lambda: F.linear(x, w),
    }
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    kernel_path = min(("panels", "tiles"), key=best.__getitem__)
    return kernel_path if best[kernel_path] <= 0.9 * best["blas"] else "blas"


@functools.cache
def avx2_kernel() -> Any | None:
    """The kernel this CPU builds without AVX-512 (an AVX2 CPU's path, e.g. AMD Zen 3), for tests."""
    flags = ["-O3", "-march=native", "-mno-avx512f"]
    return build("kvos_dense_avx2_v6", _SOURCE, ["mm", "gemm"], flags, "torch's matmul")


@functools.cache
def portable_kernel() -> Any | None:
    """The kernel built without SIMD intrinsics (a CPU without AVX2/FMA), for tests."""
    flags = ["-O3", "-DKVOS_PORTABLE"]
    return build("kvos_dense_portable_v6", _SOURCE, ["mm", "gemm"], flags, "torch's matmul")


BUILDS = {"native": kernel, "avx2": avx2_kernel, "portable": portable_kernel}  # the builds tests force
