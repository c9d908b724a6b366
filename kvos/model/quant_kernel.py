"""CPU kernels for weights kept quantized: a matmul for a few activation rows and a row dequantizer.

Two layouts, both in groups of 32 along the input dim (see :mod:`kvos.model.quant`):

- ``q4``: packed uint8 [N, K / 2] (in each group's 16 bytes the low nibbles are elements 0-15, the high ones
  16-31, GGUF's order), scale and min float32 [N, K / 32]: w = scale * q + min, q in 0..15;
- ``q8``: int8 [N, K], scale float32 [N, K / 32]: w = scale * q.

``mm(x, ..., c)`` computes c + x [n, K] @ w.T for small n straight from the packed bytes: each group's
weights are widened to float once and used for every row of x, dot products are summed per group and
scaled once, and for q4 the mins enter as min * sum(x over the group). It reads 0.5 (q4) or 1 (q8) byte per
weight where a float32 matmul reads 4, which is what decode is bound by. ``mm_i8`` quantizes x to int8
blocks first and takes integer products; with AVX-512 VNNI four 4-bit groups (or two 8-bit ones) go through
one 64-byte ``vpdpbusd``, x re-laid once a call to match the nibbles' order (2.8x the 256-bit path on
SmolLM2's products, warm caches). ``dequantize(...)`` writes
float32 rows exactly (scale * q is exact in float32, so scale * q + min is rounded once, as gguf.quants
does). Compiled on first use with ``torch.utils.cpp_extension`` (-march=native: AVX-512 intrinsics where
the CPU has them, AVX2/FMA where it has those (most CPUs without AVX-512: 3-4x the portable loops on
SmolLM2's shapes), portable loops otherwise) and cached; without a compiler, or with
``KVOS_NO_EXTENSIONS=1``, :mod:`kvos.model.quant` computes the same values with torch ops.
"""

from __future__ import annotations

import functools
from typing import Any

from kvos.extensions import build
from kvos.model import row_prefetch
from kvos.model.int8_blocks import SOURCE as INT8_BLOCKS
from kvos.model.int8_panels import SOURCE as INT8_PANELS
from kvos.model.int16_blocks import SOURCE as INT16_BLOCKS
from kvos.model.row_prefetch import SOURCE as ROW_PREFETCH

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>
#if defined(KVOS_PORTABLE)
#elif defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVOS_AVX2 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVOS_PORTABLE)
#define KVOS_INT8_SIMD 1  // integer products of int8 activations (AVX2; AVX-512 CPUs have it too)
#endif

constexpr int64_t GROUP = 32;
"""
    + ROW_PREFETCH
    + r"""
// A weight's per-row arrays for RowPrefetch: its bytes, scales and (q4) mins.
template <bool Q4>
static inline RowPrefetch row_streams(int64_t N, int64_t K, const uint8_t* w, const float* scale,
                                      const float* mins) {
  RowPrefetch prefetch(N);
  prefetch.stream(w, Q4 ? K / 2 : K).stream(scale, K / GROUP * 4);
  if (Q4) prefetch.stream(mins, K / GROUP * 4);
  return prefetch;
}

// sum_g min[g] * xsum[g]: the mins' share of one output (q4), portable version.
[[maybe_unused]] static inline float min_term(const float* mins, const float* xsum, int64_t groups) {
  float acc = 0.0f;
  for (int64_t g = 0; g < groups; ++g) acc += mins[g] * xsum[g];
  return acc;
}

#if defined(__AVX512F__)
// min[g] * xsum[g] over every group, 16 lanes at a time (the tail masked): unreduced.
static inline __m512 min_terms(const float* mins, const float* xsum, int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(mins + g), _mm512_loadu_ps(xsum + g), acc);
  if (g < groups) {
    const __mmask16 m = static_cast<__mmask16>((1u << (groups - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mins + g), _mm512_maskz_loadu_ps(m, xsum + g), acc);
  }
  return acc;
}

// One group's 32 weights widened to float: lo = elements 0-15, hi = 16-31.
template <bool Q4>
static inline void widen(const uint8_t* w, __m512& lo, __m512& hi) {
  if (Q4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i m = _mm_set1_epi8(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  }
}
#endif

#if KVOS_AVX2 || KVOS_INT8_SIMD
// min[g] * xsum[g] over every group, 8 lanes at a time, and the tail: one total.
static inline float min_terms8(const float* mins, const float* xsum, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xsum + g), acc);
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float total = 0.0f;
  for (float v : lanes) total += v;
  for (; g < groups; ++g) total += mins[g] * xsum[g];
  return total;
}

// One group's 32 weights widened to float, 8 at a time: v[0] = elements 0-7, ..., v[3] = 24-31.
template <bool Q4>
static inline void widen8(const uint8_t* w, __m256* v) {
  if (Q4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16));
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// total[i] = x_i . w_r for T rows of x (T a constant: the running sums stay in registers).
template <bool Q4, int T>
static inline void tile8(const float* x, const float* xsum, int64_t K, const uint8_t* wr, const float* sr,
                         const float* mr, float* total) {
  const int64_t groups = K / GROUP, group_bytes = Q4 ? 16 : 32;
  __m256 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 v[4];
    widen8<Q4>(wr + g * group_bytes, v);
    const __m256 s = _mm256_set1_ps(sr[g]);
    for (int i = 0; i < T; ++i) {
      const float* xg = x + i * K + g * GROUP;
      __m256 d = _mm256_mul_ps(v[0], _mm256_loadu_ps(xg));
      d = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xg + 8), d);
      d = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xg + 16), d);
      d = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xg + 24), d);
      acc[i] = _mm256_fmadd_ps(d, s, acc[i]);
    }
  }
  for (int i = 0; i < T; ++i)
    total[i] = hsum256(acc[i]) + (Q4 ? min_terms8(mr, xsum + i * groups, groups) : 0.0f);
}
#endif

// Output r for rows i0..i0+t (t <= 4) of x: per group, dot(x, q) * scale, plus sum_g min * xsum for q4.
template <bool Q4>
static inline void mm_tile(const float* x, const float* xsum, int64_t t, int64_t K, const uint8_t* wr,
                           const float* sr, const float* mr, float* out, int64_t N, bool add) {
  const int64_t groups = K / GROUP, group_bytes = Q4 ? 16 : 32;
  float total[4];
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo, hi;
    widen<Q4>(wr + g * group_bytes, lo, hi);
    const __m512 s = _mm512_set1_ps(sr[g]);
    for (int64_t i = 0; i < t; ++i) {
      const float* xg = x + i * K + g * GROUP;
      const __m512 d = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xg)));
      acc[i] = _mm512_fmadd_ps(d, s, acc[i]);
    }
  }
  for (int64_t i = 0; i < t; ++i) {
    if (Q4) acc[i] = _mm512_add_ps(acc[i], min_terms(mr, xsum + i * groups, groups));
    total[i] = _mm512_reduce_add_ps(acc[i]);  // one horizontal sum per output
  }
#elif KVOS_AVX2
  switch (t) {
    case 1: tile8<Q4, 1>(x, xsum, K, wr, sr, mr, total); break;
    case 2: tile8<Q4, 2>(x, xsum, K, wr, sr, mr, total); break;
    case 3: tile8<Q4, 3>(x, xsum, K, wr, sr, mr, total); break;
    default: tile8<Q4, 4>(x, xsum, K, wr, sr, mr, total); break;
  }
#else
  for (int64_t i = 0; i < t; ++i) {
    const float* xi = x + i * K;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* w = wr + g * group_bytes;
      const float* xg = xi + g * GROUP;
      float d = 0.0f;
      for (int64_t j = 0; j < 16; ++j) {
        const float a = Q4 ? float(w[j] & 0x0F) : float(int8_t(w[j]));
        const float b = Q4 ? float(w[j] >> 4) : float(int8_t(w[j + 16]));
        d += a * xg[j] + b * xg[j + 16];
      }
      acc += d * sr[g];
    }
    total[i] = acc;
  }
#endif
  for (int64_t i = 0; i < t; ++i) {
#if !defined(__AVX512F__) && !KVOS_AVX2
    if (Q4) total[i] += min_term(mr, xsum + i * groups, groups);
#endif
    out[i * N] = add ? out[i * N] + total[i] : total[i];
  }
}

// out[:, r0:r1] for every row of x, four rows of x at a time.
template <bool Q4>
static void mm_rows(const float* x, const float* xsum, int64_t n, int64_t K, const uint8_t* w,
                    const float* scale, const float* mins, float* out, int64_t N, int64_t r0, int64_t r1,
                    bool add) {
  const int64_t groups = K / GROUP, row_bytes = Q4 ? K / 2 : K;
  const RowPrefetch prefetch = row_streams<Q4>(N, K, w, scale, mins);
  for (int64_t r = r0; r < r1; ++r) {
    prefetch(r);
    for (int64_t i0 = 0; i0 < n; i0 += 4)
      mm_tile<Q4>(x + i0 * K, xsum + i0 * groups, std::min<int64_t>(4, n - i0), K, w + r * row_bytes,
                  scale + r * groups, Q4 ? mins + r * groups : nullptr, out + i0 * N + r, N, add);
  }
}

"""
    + INT8_BLOCKS
    + INT8_PANELS
    + r"""

#if KVOS_INT8_SIMD
// One 4-bit group's 16 bytes at p as 32 unsigned bytes: elements 0-15 (low nibbles), then 16-31 (high ones).
static inline __m256i q4_group(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
"""
    + INT16_BLOCKS
    + r"""

// total[i] = x_i . w_r for T rows of quantized x (xq int8 [T, K], xd [T, groups], xh [T, groups, 2]): per
// group the integer dot product of the weights' q with x's, scaled by both scales, plus min * (xh's halves).
template <bool Q4, int T>
static inline void tile_i8(const int8_t* xq, const float* xd, const float* xh, int64_t K, const uint8_t* wr,
                           const float* sr, const float* mr, float* total) {
  const int64_t groups = K / GROUP, group_bytes = Q4 ? 16 : 32;
  float mins[T];
  for (int i = 0; i < T; ++i) mins[i] = 0.0f;
#if KVOS_INT8_SIMD
  __m256 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i u, w = _mm256_setzero_si256();
    if (Q4) {
      u = q4_group(wr + g * 16);
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + g * 32));
      u = _mm256_sign_epi8(w, w);  // |w| (-128 reads as 128 unsigned); x takes w's sign below
    }
    for (int i = 0; i < T; ++i) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i * groups + g) * GROUP));
      if (!Q4) x = _mm256_sign_epi8(x, w);
      const __m256 p = _mm256_cvtepi32_ps(dot4(u, x));
      acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(sr[g] * xd[i * groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < T; ++i) total[i] = hsum8(acc[i]);
#else
  for (int i = 0; i < T; ++i) {
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* w = wr + g * group_bytes;
      const int8_t* x = xq + (i * groups + g) * GROUP;
      int32_t dot = 0;
      for (int64_t j = 0; j < 16; ++j) {
        const int32_t a = Q4 ? (w[j] & 0x0F) : int8_t(w[j]);
        const int32_t b = Q4 ? (w[j] >> 4) : int8_t(w[j + 16]);
        dot += a * x[j] + b * x[j + 16];
      }
      acc += static_cast<float>(dot) * (sr[g] * xd[i * groups + g]);
    }
    total[i] = acc;
  }
#endif
  if (Q4)
    for (int i = 0; i < T; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        const float* h = xh + 2 * (i * groups + g);
        mins[i] += mr[g] * (h[0] + h[1]);
      }
  for (int i = 0; i < T; ++i) total[i] += mins[i];
}

#if KVOS_VNNI512
// One 4-bit chunk (four groups, 64 bytes of weights w) against T activation rows of an Int8Chunks: the
// integer dot products of both nibble halves into 16 lanes (four a group), scaled per lane by the weight's
// and the activation's scale and accumulated; the mins' share into a 4-lane sum.
template <int T>
static inline void chunk_q4(__m512i w, __m128 s4, __m128 m4, const int8_t* xq, const float* xd,
                            const float* xs, int64_t stride, __m512* acc, __m128* macc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
  for (int i = 0; i < T; ++i) {
    const int8_t* x = xq + i * stride * 32;
    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
    p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512(x + 64));
    const __m128 sc = _mm_mul_ps(s4, _mm_loadu_ps(xd + i * stride));
    const __m512 lane_scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), lane_scales, acc[i]);
    macc[i] = _mm_fmadd_ps(m4, _mm_loadu_ps(xs + i * stride), macc[i]);
  }
}

// total[i] = x_i . w_r for T rows of x laid out as Int8Chunks (stride: chunks * 4 per row), w_r a 4-bit
// row of `groups` groups: four groups an iteration, two accumulators a row (alternate chunks).
template <int T>
static inline void tile_q4_512(const Int8Chunks& xc, int64_t i0, int64_t groups, const uint8_t* wr,
                               const float* sr, const float* mr, float* total) {
  const int64_t stride = xc.chunks * 4, full = groups / 4;
  const int8_t* xq = xc.q.data() + i0 * stride * 32;
  const float* xd = xc.d.data() + i0 * stride;
  const float* xs = xc.s.data() + i0 * stride;
  __m512 a0[T], a1[T];
  __m128 m[T];
  for (int i = 0; i < T; ++i) a0[i] = a1[i] = _mm512_setzero_ps(), m[i] = _mm_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    const int64_t g = c * 4;
    chunk_q4<T>(_mm512_loadu_si512(wr + g * 16), _mm_loadu_ps(sr + g), _mm_loadu_ps(mr + g), xq + c * 128,
                xd + g, xs + g, stride, a0, m);
    chunk_q4<T>(_mm512_loadu_si512(wr + g * 16 + 64), _mm_loadu_ps(sr + g + 4), _mm_loadu_ps(mr + g + 4),
                xq + c * 128 + 128, xd + g + 4, xs + g + 4, stride, a1, m);
  }
  for (; c < xc.chunks; ++c) {  // the last chunk or two, the final one masked to the groups there are
    const int64_t g = c * 4, left = std::min<int64_t>(4, groups - g);
    const __mmask64 bytes = left == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * left)) - 1;
    const __mmask8 lanes = static_cast<__mmask8>((1u << left) - 1);
    chunk_q4<T>(_mm512_maskz_loadu_epi8(bytes, wr + g * 16), _mm_maskz_loadu_ps(lanes, sr + g),
                _mm_maskz_loadu_ps(lanes, mr + g), xq + c * 128, xd + g, xs + g, stride, a0, m);
  }
  for (int i = 0; i < T; ++i) {
    __m128 h = _mm_add_ps(m[i], _mm_movehl_ps(m[i], m[i]));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    total[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i])) + _mm_cvtss_f32(h);
  }
}

// p[0] and p[1] if pair (else p[0] and 0), then zeros.
static inline __m128 two(const float* p, bool pair) {
  return pair ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))) : _mm_load_ss(p);
}

// total[i] = x_i . w_r for T rows of x (Int8Rows: q [n, K], d [n, groups]), w_r an 8-bit row: two groups
// (64 bytes) an iteration, |w| against x with w's sign, the tail masked.
template <int T>
static inline void tile_q8_512(const Int8Rows& xi, int64_t i0, int64_t groups, const uint8_t* wr,
                               const float* sr, float* total) {
  const int64_t K = groups * GROUP;
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 2 <= groups;
    const __mmask64 bytes = pair ? ~__mmask64(0) : (__mmask64(1) << 32) - 1;
    // plain loads where the pair is whole: masked loads from memory made this 4x slower on an AMD Zen 5
    const uint8_t* wg = wr + g * GROUP;
    const __m512i w = pair ? _mm512_loadu_si512(wg) : _mm512_maskz_loadu_epi8(bytes, wg);
    const __m512i u = _mm512_abs_epi8(w);
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const __m128 s2 = two(sr + g, pair);
    for (int i = 0; i < T; ++i) {
      const int64_t row = i0 + i;
      const int8_t* xg = xi.q.data() + row * K + g * GROUP;
      const __m512i x = pair ? _mm512_loadu_si512(xg) : _mm512_maskz_loadu_epi8(bytes, xg);
      const __m512i sx = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, sx);
      const __m128 sc = _mm_mul_ps(s2, two(xi.d.data() + row * groups + g, pair));
      const __m512 lane_scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), lane_scales, acc[i]);
    }
  }
  for (int i = 0; i < T; ++i) total[i] = _mm512_reduce_add_ps(acc[i]);
}

// The four sums in acc[0..4) (16 lanes each) as one vector [sum acc[0], ..., sum acc[3]].
static inline __m128 reduce4(const __m512* acc) {
  __m256 h[4];
  for (int j = 0; j < 4; ++j)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

// acc + one 4-bit chunk (four groups from group g of the row at wr, scales sr; `left` of them there) against
// an activation chunk (x0, x1: its values; d4: its groups' scales), scaled per lane (a short chunk masked).
static inline __m512 chunk_q4_quad(__m512i x0, __m512i x1, __m128 d4, int64_t g, int64_t left,
                                   const uint8_t* wr, const float* sr, __m512 acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512i wv;
  __m128 s4;
  if (left == 4) {  // plain loads where the chunk is whole
    wv = _mm512_loadu_si512(wr + g * 16);
    s4 = _mm_loadu_ps(sr + g);
  } else {
    wv = _mm512_maskz_loadu_epi8((__mmask64(1) << (16 * left)) - 1, wr + g * 16);
    s4 = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << left) - 1), sr + g);
  }
  const __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
  const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0), hi, x1);
  const __m512 lane_scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(s4, d4)));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), lane_scales, acc);
}

// Rows of at most this many 4-bit chunks (128 values each) go through quad_q4_512 chunk by chunk, the four
// rows' sums side by side; longer rows row by row. One thread on an AMD Zen 4, us with the weights in cache
// / from memory: 3,072 x 576 (5 chunks a row) 55.5 -> 45.4 / 111 -> 108; 896 x 896 (7 chunks) 21.2 -> 17.3 /
// about the same; 576 x 1,536 (12 chunks) 21.1 -> 18.3 in cache but 53 -> 70 from memory, where four long
// rows read side by side defeat the prefetchers (docs/benchmarks.md, session 36).
constexpr int64_t INTERLEAVE_CHUNKS = 8;

// out[0..4) = x . w_r for the four 4-bit weight rows from wr (row_bytes apart; their scales and mins
// `groups` apart) and the one activation row of an Int8Chunks (a decode step's product): each row's sum
// chunk by chunk in order (the same sums whichever way the rows interleave), each row asked for ahead as the
// tiles ask, the four sums reduced together (add: added to out).
static inline void quad_q4_512(const Int8Chunks& xc, int64_t groups, const uint8_t* wr, int64_t row_bytes,
                               const float* sr, const float* mr, float* out, bool add,
                               const RowPrefetch& prefetch, int64_t r) {
  __m512 acc[4];
  for (int j = 0; j < 4; ++j) acc[j] = min_terms(mr + j * groups, xc.s.data(), groups);
  const auto chunk = [&](int64_t c, int j, __m512i x0, __m512i x1, __m128 d4) {
    const int64_t g = c * 4;
    acc[j] = chunk_q4_quad(x0, x1, d4, g, std::min<int64_t>(4, groups - g), wr + j * row_bytes,
                           sr + j * groups, acc[j]);
  };
  const int8_t* xq = xc.q.data();  // zeros pad x's last chunk
  if (xc.chunks <= INTERLEAVE_CHUNKS) {  // short rows: the four chunk by chunk, four sums in flight
    for (int64_t j = xc.chunks; j < 4; ++j) prefetch(r + j);  // rows of fewer than four chunks
    for (int64_t c = 0; c < xc.chunks; ++c) {
      if (c < 4) prefetch(r + c);  // one row's prefetches a chunk, not all four at once
      const __m512i x0 = _mm512_loadu_si512(xq + c * 128), x1 = _mm512_loadu_si512(xq + c * 128 + 64);
      const __m128 d4 = _mm_loadu_ps(xc.d.data() + c * 4);
      for (int j = 0; j < 4; ++j) chunk(c, j, x0, x1, d4);
    }
  } else {
    for (int j = 0; j < 4; ++j) {  // row by row: each row's bytes read in order, as the prefetchers expect
      prefetch(r + j);
      for (int64_t c = 0; c < xc.chunks; ++c)
        chunk(c, j, _mm512_loadu_si512(xq + c * 128), _mm512_loadu_si512(xq + c * 128 + 64),
              _mm_loadu_ps(xc.d.data() + c * 4));
    }
  }
  const __m128 total = reduce4(acc);
  _mm_storeu_ps(out, add ? _mm_add_ps(_mm_loadu_ps(out), total) : total);
}

// out[:, r0:r1] from x quantized and re-laid for the 512-bit tiles, four rows of x at a time; with one row
// of x and 4-bit weights, four weight rows at a time (quad_q4_512), the rest by the tiles.
template <bool Q4>
static void mm_rows_512(const Int8Rows& xi, const Int8Chunks* xc, int64_t n, int64_t K, const uint8_t* w,
                        const float* scale, const float* mins, float* out, int64_t N, int64_t r0, int64_t r1,
                        bool add) {
  const int64_t groups = K / GROUP, row_bytes = Q4 ? K / 2 : K;
  const RowPrefetch prefetch = row_streams<Q4>(N, K, w, scale, mins);
  if (Q4 && n == 1)
    for (; r0 + 4 <= r1; r0 += 4) {
      quad_q4_512(*xc, groups, w + r0 * row_bytes, row_bytes, scale + r0 * groups, mins + r0 * groups,
                  out + r0, add, prefetch, r0);
    }
  each_tile(n, r0, r1, out, N, add, prefetch, [&](int64_t r, int64_t i0, auto rows, float* total) {
    constexpr int T = decltype(rows)::value;
    if constexpr (Q4)
      tile_q4_512<T>(*xc, i0, groups, w + r * row_bytes, scale + r * groups, mins + r * groups, total);
    else
      tile_q8_512<T>(xi, i0, groups, w + r * row_bytes, scale + r * groups, total);
  });
}
#endif

#if KVOS_INT8_SIMD
// out[:, panels p0..p1 (8 weight rows each)] for every row of quantized x (kvos/model/int8_panels.py):
// 4-bit groups enter as their nibbles 0..15 with the min, 8-bit ones signed.
template <bool Q4>
static void mm_panels(const Int8Rows& xi, int64_t n, int64_t K, const uint8_t* w, const float* scale,
                      const float* mins, float* out, int64_t N, int64_t p0, int64_t p1, bool add) {
  const int64_t groups = K / GROUP, row_bytes = Q4 ? K / 2 : K;
  int8_t v[GROUP];
  auto fill = [&](Panel& panel, int64_t r0, int rows) {
    for (int r = 0; r < rows; ++r) {
      const uint8_t* wr = w + (r0 + r) * row_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        const float sh[2] = {scale[(r0 + r) * groups + g], scale[(r0 + r) * groups + g]};
        const float m = Q4 ? mins[(r0 + r) * groups + g] : 0.0f;
        const float mh[2] = {m, m};
        if (Q4) {  // elements 0-15 in the low nibbles, 16-31 in the high ones
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16));
          const __m128i low = _mm_set1_epi8(0x0F);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(v), _mm_and_si128(b, low));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(v + 16), _mm_and_si128(_mm_srli_epi16(b, 4), low));
          panel.set(r, g, v, sh, mh);
        } else {
          panel.set(r, g, reinterpret_cast<const int8_t*>(wr + g * GROUP), sh, mh);
        }
      }
    }
    panel.finish(rows, 0);
  };
  if (Q4) panels_product<false, 8, false, true>(xi, n, K, out, N, p0, p1, add, fill);
  else panels_product<true, 1, false, false>(xi, n, K, out, N, p0, p1, add, fill);
}
#endif

#if KVOS_INT8_SIMD && !KVOS_VNNI512
// The rows of quantized x re-laid for the 256-bit 4-bit tile, two groups a vector: for groups 2p and 2p + 1
// of row i, lo[i][p] holds elements 0-15 of the first then of the second (the weight bytes' low nibbles,
// one load of both groups), hi[i][p] elements 16-31 of each (their high nibbles); sums[i][g] each group's
// sum (both halves of h), for the mins. An odd last group is not paired (tile_q4_pairs reads it from xi).
struct Int8Pairs {
  int64_t pairs;
  std::vector<int8_t> lo, hi;
  std::vector<float> sums;
  Int8Pairs(const Int8Rows& xi, int64_t n, int64_t groups)
      : pairs(groups / 2), lo(n * pairs * 32), hi(n * pairs * 32), sums(n * groups) {
    for (int64_t i = 0; i < n; ++i) {
      const int8_t* x = xi.q.data() + i * groups * GROUP;
      for (int64_t p = 0; p < pairs; ++p)
        for (int64_t k = 0; k < 2; ++k) {
          const int8_t* g = x + (2 * p + k) * GROUP;
          std::memcpy(lo.data() + (i * pairs + p) * 32 + 16 * k, g, 16);
          std::memcpy(hi.data() + (i * pairs + p) * 32 + 16 * k, g + 16, 16);
        }
      for (int64_t g = 0; g < groups; ++g)
        sums[i * groups + g] = xi.h[2 * (i * groups + g)] + xi.h[2 * (i * groups + g) + 1];
    }
  }
};

// Two floats at p as lanes [p[0] x 4, p[1] x 4].
static inline __m256 two_by_four(const float* p) {
  const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// total[i] = x_i . w_r for T rows of x (Int8Pairs, rows i0..), w_r a 4-bit row: two groups an iteration
// (one 32-byte load of their nibbles; the low ones against lo, the high ones against hi, each 128-bit
// half of a product one group's), then the odd last group alone, then the mins against the groups' sums.
// On a CPU without AVX512-VNNI: half the vector instructions of tile_i8's group-at-a-time loop.
template <int T>
static inline void tile_q4_pairs(const Int8Pairs& xp, const Int8Rows& xi, int64_t i0, int64_t groups,
                                 const uint8_t* wr, const float* sr, const float* mr, float* total) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < xp.pairs; ++p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + p * 32));
    const __m256i wl = _mm256_and_si256(w, low), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    const __m256 s2 = two_by_four(sr + 2 * p);
    for (int i = 0; i < T; ++i) {
      const int64_t at = ((i0 + i) * xp.pairs + p) * 32;
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp.lo.data() + at));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp.hi.data() + at));
      const __m256i sum = _mm256_add_epi32(dot4(wl, xl), dot4(wh, xh));
      const __m256 d2 = two_by_four(xi.d.data() + (i0 + i) * groups + 2 * p);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s2, d2), acc[i]);
    }
  }
  for (int i = 0; i < T; ++i) total[i] = hsum8(acc[i]);
  if (groups % 2) {  // the last group, as tile_i8 takes it
    const int64_t g = groups - 1;
    const __m256i u = q4_group(wr + g * 16);
    for (int i = 0; i < T; ++i) {
      const int64_t row = i0 + i;
      const int8_t* xg = xi.q.data() + (row * groups + g) * GROUP;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
      total[i] += hsum8(_mm256_cvtepi32_ps(dot4(u, x))) * (sr[g] * xi.d[row * groups + g]);
    }
  }
  for (int i = 0; i < T; ++i) total[i] += min_terms8(mr, xp.sums.data() + (i0 + i) * groups, groups);
}

// out[:, r0:r1] from x re-laid in pairs of groups (Int8Pairs), a 4-bit weight, four rows of x at a time.
static void mm_rows_q4_pairs(const Int8Pairs& xp, const Int8Rows& xi, int64_t n, int64_t K,
                             const uint8_t* w, const float* scale, const float* mins, float* out, int64_t N,
                             int64_t r0, int64_t r1, bool add) {
  const int64_t groups = K / GROUP;
  const RowPrefetch prefetch = row_streams<true>(N, K, w, scale, mins);
  each_tile(n, r0, r1, out, N, add, prefetch, [&](int64_t r, int64_t i0, auto rows, float* total) {
    tile_q4_pairs<decltype(rows)::value>(xp, xi, i0, groups, w + r * K / 2, scale + r * groups,
                                         mins + r * groups, total);
  });
}
#endif

// out[:, r0:r1] from quantized x, four rows of x at a time.
template <bool Q4>
static void mm_rows_i8(const int8_t* xq, const float* xd, const float* xh, int64_t n, int64_t K,
                       const uint8_t* w, const float* scale, const float* mins, float* out, int64_t N,
                       int64_t r0, int64_t r1, bool add) {
  const int64_t groups = K / GROUP, row_bytes = Q4 ? K / 2 : K;
  const RowPrefetch prefetch = row_streams<Q4>(N, K, w, scale, mins);
  each_tile(n, r0, r1, out, N, add, prefetch, [&](int64_t r, int64_t i0, auto rows, float* total) {
    const int64_t o = i0 * groups;
    tile_i8<Q4, decltype(rows)::value>(xq + o * GROUP, xd + o, xh + 2 * o, K, w + r * row_bytes,
                                       scale + r * groups, Q4 ? mins + r * groups : nullptr, total);
  });
}

// As mm, with x quantized to int8 blocks first (quantize_blocks) and integer products: what llama.cpp
// computes for these weights, by the tiles or the panels (Path, kvos/model/int8_panels.py). c [n, N] (or
// empty) + x [n, K] float32 @ w.T -> [n, N] float32.
static torch::Tensor product_i8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor mins,
                                bool q4, torch::Tensor c, Path path) {
  const int64_t n = x.size(0), K = x.size(1), N = scale.size(0), groups = K / GROUP;
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x must be contiguous float32");
  TORCH_CHECK(K % GROUP == 0 && scale.size(1) == groups, "x's columns do not match the weight");
  const bool add = c.numel() > 0;
  TORCH_CHECK(!add || (c.is_contiguous() && c.scalar_type() == torch::kFloat32 && c.size(0) == n &&
                       c.size(1) == N), "c must be contiguous float32 [n, N]");
  auto out = add ? c.clone() : torch::empty({n, N}, x.options());
  const Int8Rows xi(x.data_ptr<float>(), n, K);
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* scp = scale.data_ptr<float>();
  const float* mp = q4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
#if KVOS_INT8_SIMD
  if (takes_panels(path, n, q4 ? 1 : 0)) {
    at::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t p0, int64_t p1) {
      if (q4) mm_panels<true>(xi, n, K, wp, scp, mp, op, N, p0, p1, add);
      else mm_panels<false>(xi, n, K, wp, scp, mp, op, N, p0, p1, add);
    });
    return out;
  }
#endif
#if KVOS_VNNI512
  const std::unique_ptr<Int8Chunks> xc = q4 ? std::make_unique<Int8Chunks>(xi, n, groups) : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    if (q4) mm_rows_512<true>(xi, xc.get(), n, K, wp, scp, mp, op, N, r0, r1, add);
    else mm_rows_512<false>(xi, nullptr, n, K, wp, scp, mp, op, N, r0, r1, add);
  });
#else
#if KVOS_INT8_SIMD
  if (q4) {  // x re-laid once for every weight row: two groups a vector
    const Int8Pairs xp(xi, n, groups);
    at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
      mm_rows_q4_pairs(xp, xi, n, K, wp, scp, mp, op, N, r0, r1, add);
    });
    return out;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    if (q4) mm_rows_i8<true>(xi.q.data(), xi.d.data(), xi.h.data(), n, K, wp, scp, mp, op, N, r0, r1, add);
    else mm_rows_i8<false>(xi.q.data(), xi.d.data(), xi.h.data(), n, K, wp, scp, mp, op, N, r0, r1, add);
  });
#endif
  return out;
}

torch::Tensor mm_i8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor mins, bool q4,
                    torch::Tensor c) {
  return product_i8(x, w, scale, mins, q4, c, AUTO);
}

// mm_i8 by one path (where the CPU has the integer SIMD for panels; tests and benchmarks).
torch::Tensor mm_i8_tiles(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor mins, bool q4,
                          torch::Tensor c) {
  return product_i8(x, w, scale, mins, q4, c, TILES);
}

torch::Tensor mm_i8_panels(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor mins, bool q4,
                           torch::Tensor c) {
  return product_i8(x, w, scale, mins, q4, c, PANELS);
}

// The activations' int8 blocks as mm_i8 makes them: (q int8 [n, K], d float32 [n, K / 32]).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) % GROUP == 0,
              "x must be contiguous float32 [n, K], K a multiple of 32");
  const int64_t n = x.size(0), groups = x.size(1) / GROUP;
  const Int8Rows xi(x.data_ptr<float>(), n, x.size(1));
  auto q = torch::empty({n, x.size(1)}, torch::dtype(torch::kInt8));
  auto d = torch::empty({n, groups}, torch::dtype(torch::kFloat32));
  std::copy(xi.q.begin(), xi.q.end(), q.data_ptr<int8_t>());
  std::copy(xi.d.begin(), xi.d.end(), d.data_ptr<float>());
  return {q, d};
}

// c [n, N] (or empty) + x [n, K] float32 @ w.T -> [n, N] float32, w 8-bit (int8 [N, K], scale [N, K / 32]),
// x quantized to int16 blocks (kvos/model/int16_blocks.py): the output head's product.
torch::Tensor mm_i16(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor c) {
  const int64_t n = x.size(0), K = x.size(1), N = scale.size(0), groups = K / GROUP;
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x must be contiguous float32");
  TORCH_CHECK(K % GROUP == 0 && scale.size(1) == groups, "x's columns do not match the weight");
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.size(0) == N && w.size(1) == K,
              "w must be the contiguous int8 [N, K] of an 8-bit weight");
  const bool add = c.numel() > 0;
  TORCH_CHECK(!add || (c.is_contiguous() && c.scalar_type() == torch::kFloat32 && c.size(0) == n &&
                       c.size(1) == N), "c must be contiguous float32 [n, N]");
  auto out = add ? c.clone() : torch::empty({n, N}, x.options());
  const Int16Rows xi(x.data_ptr<float>(), n, K);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* scp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    const RowPrefetch prefetch = row_streams<false>(N, K, reinterpret_cast<const uint8_t*>(wp), scp, nullptr);
    each_tile(n, r0, r1, op, N, add, prefetch, [&](int64_t r, int64_t i0, auto rows, float* total) {
      tile_i16<decltype(rows)::value>(xi.q.data() + i0 * K, xi.d.data() + i0 * groups, K, wp + r * K,
                                      scp + r * groups, total);
    });
  });
  return out;
}

// The activations' int16 blocks as mm_i16 makes them: (q int16 [n, K], d float32 [n, K / 32]).
std::vector<torch::Tensor> quantize_activations16(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) % GROUP == 0,
              "x must be contiguous float32 [n, K], K a multiple of 32");
  const int64_t n = x.size(0), K = x.size(1);
  const Int16Rows xi(x.data_ptr<float>(), n, K);
  auto q = torch::empty({n, K}, torch::dtype(torch::kInt16));
  auto d = torch::empty({n, K / GROUP}, torch::dtype(torch::kFloat32));
  std::copy(xi.q.begin(), xi.q.end(), q.data_ptr<int16_t>());
  std::copy(xi.d.begin(), xi.d.end(), d.data_ptr<float>());
  return {q, d};
}

// c [n, N] (or empty) + x [n, K] float32 @ w.T -> [n, N] float32; mins is empty for q8.
torch::Tensor mm(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor mins, bool q4,
                 torch::Tensor c) {
  const int64_t n = x.size(0), K = x.size(1), N = scale.size(0), groups = K / GROUP;
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x must be contiguous float32");
  TORCH_CHECK(K % GROUP == 0 && scale.size(1) == groups, "x's columns do not match the weight");
  const bool add = c.numel() > 0;
  TORCH_CHECK(!add || (c.is_contiguous() && c.scalar_type() == torch::kFloat32 && c.size(0) == n &&
                       c.size(1) == N), "c must be contiguous float32 [n, N]");
  auto out = add ? c.clone() : torch::empty({n, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(q4 ? n * groups : 0);  // each group's sum of x, for the mins
  for (size_t b = 0; b < xsum.size(); ++b) {
    float acc = 0.0f;
    for (int64_t j = 0; j < GROUP; ++j) acc += xp[b * GROUP + j];
    xsum[b] = acc;
  }
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* scp = scale.data_ptr<float>();
  const float* mp = q4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    if (q4) mm_rows<true>(xp, xsum.data(), n, K, wp, scp, mp, op, N, r0, r1, add);
    else mm_rows<false>(xp, xsum.data(), n, K, wp, scp, mp, op, N, r0, r1, add);
  });
  return out;
}

// The rows of w as float32 [N, K]: scale * q + min (q4) or scale * q (q8), exact products, one rounding.
torch::Tensor dequantize(torch::Tensor w, torch::Tensor scale, torch::Tensor mins, bool q4) {
  const int64_t N = scale.size(0), groups = scale.size(1), K = groups * GROUP;
  auto out = torch::empty({N, K}, scale.options());
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* scp = scale.data_ptr<float>();
  const float* mp = q4 ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * groups, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* o = op + b * GROUP;
      const float s = scp[b], m = q4 ? mp[b] : 0.0f;
      if (q4) {
        const uint8_t* q = wp + b * 16;
        for (int64_t j = 0; j < 16; ++j) {
          o[j] = s * float(q[j] & 0x0F) + m;
          o[j + 16] = s * float(q[j] >> 4) + m;
        }
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(wp) + b * GROUP;
        for (int64_t j = 0; j < GROUP; ++j) o[j] = s * float(q[j]);
      }
    }
  });
  return out;
}

// The products by address, for the step kernel (kvos/model/step_kernel.py): out = c + x @ W.T with the
// weight's tensors t = {w, scale, mins} and q4 as `arg`, the call kvos.model.quant.NativePart describes.
static torch::Tensor entry_i8(const torch::Tensor& x, const std::vector<torch::Tensor>& t, int64_t arg,
                              const torch::Tensor& c) {
  return mm_i8(x, t[0], t[1], t[2], arg != 0, c);
}

static torch::Tensor entry_f32(const torch::Tensor& x, const std::vector<torch::Tensor>& t, int64_t arg,
                               const torch::Tensor& c) {
  return mm(x, t[0], t[1], t[2], arg != 0, c);
}

// The addresses of entry_i8 and entry_f32 (valid while this module is loaded: for the process).
std::vector<int64_t> entries() {
  return {reinterpret_cast<int64_t>(&entry_i8), reinterpret_cast<int64_t>(&entry_f32)};
}
"""
)

FUNCTIONS = [
    "entries",
    "mm",
    "mm_i8",
    "mm_i8_tiles",
    "mm_i8_panels",
    "mm_i16",
    "has_panels",
    "set_panel_rows",
    "panel_rows_of",
    "set_prefetch_level",
    "prefetch_level_of",
    "quantize_activations",
    "quantize_activations16",
    "dequantize",
]
NAME = "kvos_quant_v11"  # the build's name (and its cache directory's)


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why), set
    to this machine's level for where its decode products' rows asked for ahead go (``row_prefetch``)."""
    return row_prefetch.apply(build(NAME, _SOURCE, FUNCTIONS, ["-O3", "-march=native"], "torch ops"))


@functools.cache
def avx2_kernel() -> Any | None:
    """The kernels this CPU builds without AVX-512 (the path of an AVX2 CPU such as AMD Zen 3), for tests on a
    CPU with AVX-512."""
    flags = ["-O3", "-march=native", "-mno-avx512f"]
    return build("kvos_quant_avx2_v11", _SOURCE, FUNCTIONS, flags, "torch ops")


@functools.cache
def portable_kernel() -> Any | None:
    """The same kernels built without SIMD intrinsics (the path of a CPU without AVX2/FMA), for tests."""
    return build("kvos_quant_portable_v11", _SOURCE, FUNCTIONS, ["-O3", "-DKVOS_PORTABLE"], "torch ops")
