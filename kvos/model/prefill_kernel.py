"""A CPU kernel for a prefill's attention: many queries of one sequence over its keys, causal by position.

``attend(q, k, v, q_pos, k_pos, window)`` computes what :func:`kvos.model.attention.paged_attention` gives
torch's scaled dot-product attention for a prefill: q float32 [n, H, D] (H query heads in groups of H / Hkv
sharing a KV head), k, v float32 [T, Hkv, D], q_pos int64 [n] and k_pos int64 [T] the rotary positions; a
query sees a key at or before its position (and after ``position - window`` when ``window`` > 0). Returns
float32 [n, H * D], softmax(q k^T / sqrt(D)) v per head.

How: the keys of each KV head are packed transposed ([D, T]), and a tile of 6 query rows (the query heads
of a KV head, query after query) runs over 64 keys at a time: the scores by broadcasting each query's value
at d against 32 keys (two 512-bit vectors; 16 keys in 256-bit ones on an AVX2 CPU), a running maximum and
sum per row (the online softmax of flash attention), then the probabilities times the values 32 dimensions
at a time. A block of keys none of a tile's queries sees is skipped, so a fresh prefill does half the
products. On Qwen2.5-0.5B's shapes (two threads of an AMD EPYC Zen 5) it took 0.86 ms where torch's CPU
flash attention took 2.04 (130 queries after 500 keys), 1.11 against 3.89 (420 fresh), 13.0 against 22.3
(512 after 1,536) (docs/benchmarks.md). AVX2/FMA at least (head dims a multiple of 16); without it, or for
other head dims, :func:`takes` says no and torch's attention runs. The portable build (plain loops, the same
results to rounding) is for tests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvos.extensions import build
from kvos.model.simd_exp import SOURCE as EXP8
from kvos.model.simd_vec import SOURCE as SIMD_VEC

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX2 1
#if defined(__AVX512F__)
#define KVOS_AVX512 1
#endif
#endif
"""
    + EXP8
    + SIMD_VEC
    + r"""
constexpr int64_t ROWS = 6;     // query rows a tile
constexpr int64_t KEYS = 64;    // keys a block
constexpr int64_t MAX_D = 256;  // head dims up to this
constexpr float NEG = -std::numeric_limits<float>::infinity();
constexpr int32_t FAR = std::numeric_limits<int32_t>::max();  // a padding key's position: never seen

struct Problem {
  const float *q, *v;
  int64_t n, H, Hkv, G, D, T, Tpad;
  const int32_t* qpos;    // [n]
  const int32_t* kpos;    // [Tpad], FAR past T
  const int32_t* bmin;    // [Tpad / KEYS] smallest key position of each block
  const int32_t* bmax;    // [Tpad / KEYS] largest (FAR where the block has padding)
  const float* kt;        // [Hkv][D][Tpad] the keys transposed, zeros past T
  int32_t window;         // 0: none
  float scale;
  float* out;             // [n, H * D]
};

static inline bool sees(int32_t qp, int32_t kp, int32_t window) {
  return kp <= qp && (window == 0 || kp > qp - window);
}

// The largest of a block's KEYS scores.
static inline float row_max(const float* s) {
#if KVOS_AVX2
  __m256 top = _mm256_load_ps(s);
  for (int64_t j = 8; j < KEYS; j += 8) top = _mm256_max_ps(top, _mm256_load_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  return *std::max_element(lanes, lanes + 8);
#else
  return *std::max_element(s, s + KEYS);
#endif
}

// o[0:D] *= by.
static inline void rescale(float* o, int64_t D, float by) {
#if KVOS_AVX2
  const __m256 f = _mm256_set1_ps(by);
  for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), f));
#else
  for (int64_t d = 0; d < D; ++d) o[d] *= by;
#endif
}

#if KVOS_AVX2
// o[r][d0, d0 + V * LANES) += p[r][j] v_j over a block's first `keys` keys (from j0, KV head h).
template <int V>
static inline void add_values(const Problem& P, int64_t h, int64_t j0, int64_t keys, const float (*p)[KEYS],
                              float (*o)[MAX_D], int64_t d0) {
  Vec acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vload(&o[r][d0 + v * LANES]);
  for (int64_t j = 0; j < keys; ++j) {
    const float* vj = P.v + ((j0 + j) * P.Hkv + h) * P.D + d0;
    Vec values[V];
    for (int v = 0; v < V; ++v) values[v] = vload(vj + v * LANES);
    for (int r = 0; r < ROWS; ++r) {
      const Vec pr = vbroadcast(&p[r][j]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(pr, values[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) vstore(&o[r][d0 + v * LANES], acc[r][v]);
}
#endif

// One tile: KV head h, query rows [r0, r0 + R) (row r: query r / G, head h * G + r % G).
static void tile(const Problem& P, int64_t h, int64_t r0, int64_t R) {
  const int64_t D = P.D;
  alignas(64) float qs[ROWS][MAX_D];
  alignas(64) float o[ROWS][MAX_D];
  alignas(64) float s[ROWS][KEYS];
  float m[ROWS], l[ROWS];
  int32_t qp[ROWS];
  int32_t qmin = FAR, qmax = std::numeric_limits<int32_t>::min();
  for (int64_t r = 0; r < ROWS; ++r) {
    m[r] = NEG;
    l[r] = 0.0f;
    const int64_t row = std::min(r0 + r, r0 + R - 1);  // rows past R repeat the last one, unwritten
    const int64_t i = row / P.G, head = h * P.G + row % P.G;
    qp[r] = P.qpos[i];
    qmin = std::min(qmin, qp[r]);
    qmax = std::max(qmax, qp[r]);
    const float* src = P.q + (i * P.H + head) * D;
    for (int64_t d = 0; d < D; ++d) {
      qs[r][d] = src[d] * P.scale;
      o[r][d] = 0.0f;
    }
  }
  const float* kt = P.kt + h * D * P.Tpad;
  for (int64_t j0 = 0; j0 < P.T; j0 += KEYS) {
    const int64_t b = j0 / KEYS, keys = std::min(KEYS, P.T - j0);
    if (P.bmin[b] > qmax) continue;                                     // after every query
    if (P.window > 0 && P.bmax[b] != FAR && P.bmax[b] <= qmin - P.window) continue;  // before every window
    const bool whole = P.bmax[b] <= qmin && (P.window == 0 || P.bmin[b] > qmax - P.window);
#if KVOS_AVX2
    for (int64_t c = 0; c < KEYS; c += 2 * LANES) {
      Vec acc[ROWS][2];
      for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = vzero();
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * P.Tpad + j0 + c;
        const Vec k0 = vload(kd), k1 = vload(kd + LANES);
        for (int r = 0; r < ROWS; ++r) {
          const Vec x = vbroadcast(&qs[r][d]);
          acc[r][0] = vfma(x, k0, acc[r][0]);
          acc[r][1] = vfma(x, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        vstore(&s[r][c], acc[r][0]);
        vstore(&s[r][c + LANES], acc[r][1]);
      }
    }
#else
    for (int r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < KEYS; ++j) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += qs[r][d] * kt[d * P.Tpad + j0 + j];
        s[r][j] = acc;
      }
#endif
    if (!whole)
      for (int r = 0; r < ROWS; ++r)
        for (int64_t j = 0; j < KEYS; ++j)
          if (!sees(qp[r], P.kpos[j0 + j], P.window)) s[r][j] = NEG;
    for (int r = 0; r < ROWS; ++r) {
      const float top = row_max(s[r]);
      if (top == NEG) {  // this row sees none of the block
        for (int64_t j = 0; j < KEYS; ++j) s[r][j] = 0.0f;
        continue;
      }
      const float mnew = std::max(m[r], top), keep = std::exp(m[r] - mnew);
      float sum = 0.0f;
#if KVOS_AVX2
      const __m256 shift = _mm256_set1_ps(mnew);
      __m256 total = _mm256_setzero_ps();
      for (int64_t j = 0; j < KEYS; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&s[r][j]), shift));
        _mm256_storeu_ps(&s[r][j], e);
        total = _mm256_add_ps(total, e);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, total);
      for (float x : lanes) sum += x;
#else
      for (int64_t j = 0; j < KEYS; ++j) {
        s[r][j] = std::exp(s[r][j] - mnew);
        sum += s[r][j];
      }
#endif
      l[r] = l[r] * keep + sum;
      if (keep != 1.0f) rescale(o[r], D, keep);
      m[r] = mnew;
    }
    // o += p v over the block's keys (padding keys have p = 0 and are not read)
#if KVOS_AVX2
    int64_t d0 = 0;
    for (; d0 + 2 * LANES <= D; d0 += 2 * LANES) add_values<2>(P, h, j0, keys, s, o, d0);
    for (; d0 < D; d0 += LANES) add_values<1>(P, h, j0, keys, s, o, d0);
#else
    for (int r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < keys; ++j) {
        const float* vj = P.v + ((j0 + j) * P.Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) o[r][d] += s[r][j] * vj[d];
      }
#endif
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r0 + r, i = row / P.G, head = h * P.G + row % P.G;
    float* dst = P.out + (i * P.H + head) * D;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = o[r][d] * inv;
  }
}

// Whether this build runs the AVX2 loops.
bool vectorised() {
#if KVOS_AVX2
  return true;
#else
  return false;
#endif
}

// q [n, H, D], k, v [T, Hkv, D] float32; q_pos [n], k_pos [T] int64; window 0 for none -> [n, H * D].
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor q_pos,
                     torch::Tensor k_pos, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32,
              "float32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [n, H, D], k and v [T, Hkv, D]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), T = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hkv == 0 && D % 16 == 0 && D <= MAX_D, "head dims a multiple of 16");
  TORCH_CHECK(q_pos.numel() == n && k_pos.numel() == T && T > 0, "one position per query and key");
  const int64_t Tpad = (T + KEYS - 1) / KEYS * KEYS, blocks = Tpad / KEYS;
  std::vector<int32_t> qpos(n), kpos(Tpad, FAR), bmin(blocks, FAR), bmax(blocks, 0);
  auto qp = q_pos.to(torch::kInt64).contiguous(), kp = k_pos.to(torch::kInt64).contiguous();
  for (int64_t i = 0; i < n; ++i) qpos[i] = static_cast<int32_t>(qp.data_ptr<int64_t>()[i]);
  for (int64_t j = 0; j < Tpad; ++j) {
    if (j < T) kpos[j] = static_cast<int32_t>(kp.data_ptr<int64_t>()[j]);
    bmin[j / KEYS] = std::min(bmin[j / KEYS], kpos[j]);
    bmax[j / KEYS] = std::max(bmax[j / KEYS], kpos[j]);
  }
  auto kt = torch::zeros({Hkv, D, Tpad}, q.options());
  const float* kp32 = k.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  at::parallel_for(0, Hkv * D, 1, [&](int64_t a, int64_t b) {
    for (int64_t hd = a; hd < b; ++hd) {
      const int64_t h = hd / D, d = hd % D;
      float* dst = ktp + hd * Tpad;
      for (int64_t j = 0; j < T; ++j) dst[j] = kp32[(j * Hkv + h) * D + d];
    }
  });
  auto out = torch::empty({n, H * D}, q.options());
  const int64_t G = H / Hkv;
  Problem P{q.data_ptr<float>(), v.data_ptr<float>(), n, H, Hkv, G, D, T, Tpad, qpos.data(),
            kpos.data(), bmin.data(), bmax.data(), ktp, static_cast<int32_t>(window),
            1.0f / std::sqrt(static_cast<float>(D)), out.data_ptr<float>()};
  const int64_t tiles = (n * G + ROWS - 1) / ROWS, items = Hkv * tiles;
  // items in the order first, last, second, second to last, ...: a thread's contiguous share mixes early
  // queries (few keys) with late ones (many)
  at::parallel_for(0, items, 1, [&](int64_t a, int64_t b) {
    for (int64_t x = a; x < b; ++x) {
      const int64_t item = x % 2 == 0 ? x / 2 : items - 1 - x / 2;
      const int64_t h = item / tiles, r0 = (item % tiles) * ROWS;
      tile(P, h, r0, std::min(ROWS, n * G - r0));
    }
  });
  return out;
}
"""
)

FUNCTIONS = ["attend", "vectorised"]


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    return build("kvos_prefill_v5", _SOURCE, FUNCTIONS, ["-O3", "-march=native"], "torch's attention")


@functools.cache
def portable_kernel() -> Any | None:
    """The kernel built without SIMD intrinsics, for tests."""
    flags = ["-O3", "-DKVOS_PORTABLE"]
    return build("kvos_prefill_portable_v5", _SOURCE, FUNCTIONS, flags, "torch's attention")


@functools.cache
def avx2_kernel() -> Any | None:
    """The kernel this CPU builds without AVX-512 (an AVX2 CPU's path, e.g. AMD Zen 3), for tests."""
    flags = ["-O3", "-march=native", "-mno-avx512f"]
    return build("kvos_prefill_avx2_v5", _SOURCE, FUNCTIONS, flags, "torch's attention")


BUILDS = {"native": kernel, "avx2": avx2_kernel, "portable": portable_kernel}  # the builds tests force


def takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`attend` runs this prefill's attention here: float32 on the CPU, more than one query,
    head dims a multiple of 16 up to 256, and a build with AVX2 (the portable loops are slower than torch)."""
    d = q.shape[-1]
    return (
        q.dtype == k.dtype == torch.float32
        and q.device.type == "cpu"
        and q.shape[0] > 1
        and d % 16 == 0
        and d <= 256
        and simd()
    )


@functools.cache
def simd() -> bool:
    """Whether this CPU's build of the kernel is the AVX2 one (the portable loops are only for tests)."""
    module = kernel()
    return module is not None and bool(module.vectorised())


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    module: Any | None = None,
) -> torch.Tensor:
    """The kernel's attention (``module``, default this CPU's build) on contiguous float32 operands: q [n, H,
    D], k, v [T, Hkv, D], positions int64 [n] / [T], ``window`` None for none -> [n, H * D]."""
    module = module or kernel()
    assert module is not None, "takes() said the kernel runs here"
    return module.attend(
        q.contiguous(), k.contiguous(), v.contiguous(), q_pos.cpu(), k_pos.cpu(), window or 0
    )
