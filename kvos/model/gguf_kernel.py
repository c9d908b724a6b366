"""CPU kernels over GGUF's own quantized blocks: a matmul for a few activation rows and a row dequantizer.

A weight is its file's bytes, uint8 [N, row_bytes]: each row ``K / block_values`` blocks of one type, exactly
as llama.cpp lays them out, so it takes no more memory than the file. Every type is read through one
interface: a decoder turns the 32 weights of group ``g`` of a row into 32 small integers ``q`` (int8), a
scale for each half of 16 and, for the types with a minimum, a min for each half: w = scale * q (+ min). The
32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) have one group a block; the K-quants and IQ4_XS have 8
groups in a super-block of 256, with 6- or 8-bit sub-scales (16 values each for Q2_K, Q3_K and Q6_K). Type
ids follow :data:`TYPE_IDS`.

``mm(x, w, type, c)`` computes c + x [n, K] @ w.T for small n: each group is decoded once per 4 activation
rows, its dot products summed per half in float32 and scaled once, and the mins enter as min * sum(x over the
half). ``dequantize(w, type, K)`` writes float32 rows with the decoders' exact products (scale * q is the
product gguf.quants forms, and the min is added once), bit-identical to ``gguf.quants.dequantize``.
With int8 activations on a CPU with AVX-512 VNNI, Q5_0/Q5_1 (four blocks' nibbles in one 64-byte vector, the
fifth bits set through byte masks; with AVX512-VBMI four whole blocks gathered by byte permutes) and Q6_K (a
half super-block's 6-bit values in two vectors, in the values' own order) skip the decoders: 1.4x and 2.5x
the decoder path on Qwen2.5-Coder-0.5B's products (warm caches), the permutes 1.2x more for Q5_0.
Compiled on first use (AVX2/FMA intrinsics for the products where the CPU has them, portable loops otherwise);
without a compiler, or with ``KVOS_NO_EXTENSIONS=1``, :mod:`kvos.model.gguf_weight` falls back to
gguf.quants and torch.
"""

from __future__ import annotations

import functools
from typing import Any

from kvos.extensions import build
from kvos.model import row_prefetch
from kvos.model.int8_blocks import SOURCE as INT8_BLOCKS
from kvos.model.int8_panels import SOURCE as INT8_PANELS
from kvos.model.row_prefetch import SOURCE as ROW_PREFETCH

TYPE_IDS = {
    "Q4_0": 0,
    "Q4_1": 1,
    "Q5_0": 2,
    "Q5_1": 3,
    "Q8_0": 4,
    "Q2_K": 5,
    "Q3_K": 6,
    "Q4_K": 7,
    "Q5_K": 8,
    "Q6_K": 9,
    "IQ4_NL": 10,
    "IQ4_XS": 11,
}

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX2 1
#define KVOS_INT8_SIMD 1  // integer products of int8 activations (kvos/model/int8_blocks.py)
#endif

enum Type { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS };

// 32 weights: w[j] = s[j / 16] * q[j] + m[j / 16] (m only for the types with a minimum).
struct Group {
  alignas(32) int8_t q[32];
  float s[2];
  float m[2];
};

static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if KVOS_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

static inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

static inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Values and bytes of one block, and whether its weights have a minimum term.
template <int T> struct Layout;
#define LAYOUT(T, V, B, M)                   \
  template <> struct Layout<T> {             \
    static constexpr int64_t VALUES = V;     \
    static constexpr int64_t BYTES = B;      \
    static constexpr bool MIN = M;           \
  };
LAYOUT(Q4_0, 32, 18, false)
LAYOUT(Q4_1, 32, 20, true)
LAYOUT(Q5_0, 32, 22, false)
LAYOUT(Q5_1, 32, 24, true)
LAYOUT(Q8_0, 32, 34, false)
LAYOUT(Q2_K, 256, 84, true)
LAYOUT(Q3_K, 256, 110, false)
LAYOUT(Q4_K, 256, 144, true)
LAYOUT(Q5_K, 256, 176, true)
LAYOUT(Q6_K, 256, 210, false)
LAYOUT(IQ4_NL, 32, 18, false)
LAYOUT(IQ4_XS, 256, 136, false)

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
static inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The block holding group g of a row, and g's index within it.
template <int T>
static inline const uint8_t* block_of(const uint8_t* row, int64_t g, int& j) {
  constexpr int64_t per = Layout<T>::VALUES / 32;
  j = static_cast<int>(g % per);
  return row + (g / per) * Layout<T>::BYTES;
}

template <int T> static inline void decode(const uint8_t* row, int64_t g, Group& G);

template <> inline void decode<Q4_0>(const uint8_t* row, int64_t g, Group& G) {
  const uint8_t* b = row + g * 18;
  G.s[0] = G.s[1] = f16(b);
  for (int l = 0; l < 16; ++l) {
    G.q[l] = static_cast<int8_t>((b[2 + l] & 0x0F) - 8);
    G.q[l + 16] = static_cast<int8_t>((b[2 + l] >> 4) - 8);
  }
}

template <> inline void decode<Q4_1>(const uint8_t* row, int64_t g, Group& G) {
  const uint8_t* b = row + g * 20;
  G.s[0] = G.s[1] = f16(b);
  G.m[0] = G.m[1] = f16(b + 2);
  for (int l = 0; l < 16; ++l) {
    G.q[l] = static_cast<int8_t>(b[4 + l] & 0x0F);
    G.q[l + 16] = static_cast<int8_t>(b[4 + l] >> 4);
  }
}

template <bool OFFSET>
static inline void decode_q5(const uint8_t* qs, uint32_t qh, Group& G) {
  const int off = OFFSET ? 16 : 0;
  for (int l = 0; l < 16; ++l) {
    G.q[l] = static_cast<int8_t>(((qs[l] & 0x0F) | (((qh >> l) & 1) << 4)) - off);
    G.q[l + 16] = static_cast<int8_t>(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - off);
  }
}

template <> inline void decode<Q5_0>(const uint8_t* row, int64_t g, Group& G) {
  const uint8_t* b = row + g * 22;
  G.s[0] = G.s[1] = f16(b);
  decode_q5<true>(b + 6, u32(b + 2), G);
}

template <> inline void decode<Q5_1>(const uint8_t* row, int64_t g, Group& G) {
  const uint8_t* b = row + g * 24;
  G.s[0] = G.s[1] = f16(b);
  G.m[0] = G.m[1] = f16(b + 2);
  decode_q5<false>(b + 8, u32(b + 4), G);
}

template <> inline void decode<Q8_0>(const uint8_t* row, int64_t g, Group& G) {
  const uint8_t* b = row + g * 34;
  G.s[0] = G.s[1] = f16(b);
  std::memcpy(G.q, b + 2, 32);
}

template <> inline void decode<IQ4_NL>(const uint8_t* row, int64_t g, Group& G) {
  const uint8_t* b = row + g * 18;
  G.s[0] = G.s[1] = f16(b);
  for (int l = 0; l < 16; ++l) {
    G.q[l] = KVALUES[b[2 + l] & 0x0F];
    G.q[l + 16] = KVALUES[b[2 + l] >> 4];
  }
}

// Q2_K: scales[16] (4-bit scale, 4-bit min), qs[64] (2 bits), d, dmin.
// Group j: 128-chunk j / 4, shift 2 (j % 4).
template <> inline void decode<Q2_K>(const uint8_t* row, int64_t g, Group& G) {
  int j;
  const uint8_t* b = block_of<Q2_K>(row, g, j);
  const float d = f16(b + 80), dmin = f16(b + 82);
  const int n = j / 4, shift = 2 * (j % 4);
  const uint8_t* q = b + 16 + n * 32;
  for (int h = 0; h < 2; ++h) {
    const uint8_t sc = b[n * 8 + 2 * (j % 4) + h];
    G.s[h] = d * static_cast<float>(sc & 0x0F);
    G.m[h] = -(dmin * static_cast<float>(sc >> 4));
  }
  for (int l = 0; l < 32; ++l) G.q[l] = static_cast<int8_t>((q[l] >> shift) & 3);
}

// Q3_K: hmask[32], qs[64], scales[12] (16 6-bit scales, offset 32), d.
template <> inline void decode<Q3_K>(const uint8_t* row, int64_t g, Group& G) {
  int j;
  const uint8_t* b = block_of<Q3_K>(row, g, j);
  const float d = f16(b + 108);
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
  aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
  aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
  aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
  const int8_t* scales = reinterpret_cast<const int8_t*>(aux);
  const int n = j / 4, k = j % 4, shift = 2 * k;
  const uint8_t mask = static_cast<uint8_t>(1u << (4 * n + k));
  const uint8_t* q = b + 32 + n * 32;
  for (int h = 0; h < 2; ++h) G.s[h] = d * static_cast<float>(scales[n * 8 + 2 * k + h] - 32);
  for (int l = 0; l < 32; ++l)
    G.q[l] = static_cast<int8_t>(((q[l] >> shift) & 3) - ((b[l] & mask) ? 0 : 4));
}

// Q4_K: d, dmin, scales[12] (8 6-bit scales and mins), qs[128]: sub-block j is 64-chunk j / 2's low or
// high nibbles.
template <> inline void decode<Q4_K>(const uint8_t* row, int64_t g, Group& G) {
  int j;
  const uint8_t* b = block_of<Q4_K>(row, g, j);
  int sc, mn;
  scale_min_k4(j, b + 4, sc, mn);
  G.s[0] = G.s[1] = f16(b) * static_cast<float>(sc);
  G.m[0] = G.m[1] = -(f16(b + 2) * static_cast<float>(mn));
  const uint8_t* q = b + 16 + (j / 2) * 32;
  const int shift = 4 * (j % 2);
  for (int l = 0; l < 32; ++l) G.q[l] = static_cast<int8_t>((q[l] >> shift) & 0x0F);
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]: as Q4_K with a fifth bit from qh (bit j of each byte).
template <> inline void decode<Q5_K>(const uint8_t* row, int64_t g, Group& G) {
  int j;
  const uint8_t* b = block_of<Q5_K>(row, g, j);
  int sc, mn;
  scale_min_k4(j, b + 4, sc, mn);
  G.s[0] = G.s[1] = f16(b) * static_cast<float>(sc);
  G.m[0] = G.m[1] = -(f16(b + 2) * static_cast<float>(mn));
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48 + (j / 2) * 32;
  const int shift = 4 * (j % 2);
  for (int l = 0; l < 32; ++l)
    G.q[l] = static_cast<int8_t>(((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4));
}

// Q6_K: ql[128], qh[64], int8 scales[16], d: group j is 128-chunk j / 4, quadrant j % 4.
template <> inline void decode<Q6_K>(const uint8_t* row, int64_t g, Group& G) {
  int j;
  const uint8_t* b = block_of<Q6_K>(row, g, j);
  const float d = f16(b + 208);
  const int n = j / 4, k = j % 4;
  const uint8_t* ql = b + n * 64 + (k % 2) * 32;
  const uint8_t* qh = b + 128 + n * 32;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + n * 8 + 2 * k;
  const int lshift = 4 * (k / 2), hshift = 2 * k;
  for (int h = 0; h < 2; ++h) G.s[h] = d * static_cast<float>(sc[h]);
  for (int l = 0; l < 32; ++l)
    G.q[l] = static_cast<int8_t>((((ql[l] >> lshift) & 0x0F) | (((qh[l] >> hshift) & 3) << 4)) - 32);
}

// IQ4_XS: d, scales_h (16 bits), scales_l[4], qs[128]: group j has a 6-bit scale (offset 32) and 16 bytes
// of 4-bit indices into KVALUES.
template <> inline void decode<IQ4_XS>(const uint8_t* row, int64_t g, Group& G) {
  int j;
  const uint8_t* b = block_of<IQ4_XS>(row, g, j);
  uint16_t high;
  std::memcpy(&high, b + 2, 2);
  const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
  G.s[0] = G.s[1] = f16(b) * static_cast<float>(ls - 32);
  const uint8_t* q = b + 8 + j * 16;
  for (int l = 0; l < 16; ++l) {
    G.q[l] = KVALUES[q[l] & 0x0F];
    G.q[l + 16] = KVALUES[q[l] >> 4];
  }
}

// Every group of the block at b (1 for the 32-value types, 8 for the 256-value ones) into G[0..].
template <int T>
static inline void decode_block(const uint8_t* b, Group* G) {
  constexpr int per = static_cast<int>(Layout<T>::VALUES / 32);
  for (int j = 0; j < per; ++j) decode<T>(b, j, G[j]);
}

#if KVOS_AVX2
// Bit l of `bits` as byte l: 0xFF where set, 0 where clear.
static inline __m256i spread_bits(uint32_t bits) {
  const __m256i rep = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(rep, sel), sel);
}

// 16 bytes of nibbles -> 32 bytes: the low nibbles (elements 0-15), then the high ones (16-31).
static inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

static inline __m256i bits_at(const uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}

static inline void put(Group& G, __m256i q) { _mm256_store_si256(reinterpret_cast<__m256i*>(G.q), q); }

static inline __m256i kvalues(__m256i idx) {
  const __m128i lanes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(KVALUES));
  const __m256i table = _mm256_broadcastsi128_si256(lanes);
  return _mm256_shuffle_epi8(table, idx);
}

template <> inline void decode_block<Q4_0>(const uint8_t* b, Group* G) {
  G[0].s[0] = G[0].s[1] = f16(b);
  put(G[0], _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)));
}

template <> inline void decode_block<Q4_1>(const uint8_t* b, Group* G) {
  G[0].s[0] = G[0].s[1] = f16(b);
  G[0].m[0] = G[0].m[1] = f16(b + 2);
  put(G[0], nibbles(b + 4));
}

template <> inline void decode_block<Q5_0>(const uint8_t* b, Group* G) {
  G[0].s[0] = G[0].s[1] = f16(b);
  const __m256i high = _mm256_and_si256(spread_bits(u32(b + 2)), _mm256_set1_epi8(0x10));
  put(G[0], _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), high), _mm256_set1_epi8(16)));
}

template <> inline void decode_block<Q5_1>(const uint8_t* b, Group* G) {
  G[0].s[0] = G[0].s[1] = f16(b);
  G[0].m[0] = G[0].m[1] = f16(b + 2);
  const __m256i high = _mm256_and_si256(spread_bits(u32(b + 4)), _mm256_set1_epi8(0x10));
  put(G[0], _mm256_or_si256(nibbles(b + 8), high));
}

template <> inline void decode_block<IQ4_NL>(const uint8_t* b, Group* G) {
  G[0].s[0] = G[0].s[1] = f16(b);
  put(G[0], kvalues(nibbles(b + 2)));
}

template <> inline void decode_block<IQ4_XS>(const uint8_t* b, Group* G) {
  const float d = f16(b);
  uint16_t high;
  std::memcpy(&high, b + 2, 2);
  for (int j = 0; j < 8; ++j) {
    const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
    G[j].s[0] = G[j].s[1] = d * static_cast<float>(ls - 32);
    put(G[j], kvalues(nibbles(b + 8 + j * 16)));
  }
}

template <bool FIFTH>
static inline void decode_k4(const uint8_t* b, Group* G) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* q = b + (FIFTH ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(j, b + 4, sc, mn);
    G[j].s[0] = G[j].s[1] = d * static_cast<float>(sc);
    G[j].m[0] = G[j].m[1] = -(dmin * static_cast<float>(mn));
    __m256i v = bits_at(q + (j / 2) * 32, 4 * (j % 2), 0x0F);
    if (FIFTH) v = _mm256_or_si256(v, _mm256_slli_epi16(bits_at(b + 16, j, 1), 4));
    put(G[j], v);
  }
}

template <> inline void decode_block<Q4_K>(const uint8_t* b, Group* G) { decode_k4<false>(b, G); }
template <> inline void decode_block<Q5_K>(const uint8_t* b, Group* G) { decode_k4<true>(b, G); }

template <> inline void decode_block<Q6_K>(const uint8_t* b, Group* G) {
  const float d = f16(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int j = 0; j < 8; ++j) {
    const int n = j / 4, k = j % 4;
    const __m256i lo = bits_at(b + n * 64 + (k % 2) * 32, 4 * (k / 2), 0x0F);
    const __m256i hi = _mm256_slli_epi16(bits_at(b + 128 + n * 32, 2 * k, 3), 4);
    for (int h = 0; h < 2; ++h) G[j].s[h] = d * static_cast<float>(sc[n * 8 + 2 * k + h]);
    put(G[j], _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32)));
  }
}
#endif

#if KVOS_AVX2
static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m256 widen(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
#endif

// total[i] = x_i . w_r for the R (<= 4) rows of x starting at x, from row w_r's bytes.
template <int T, int R>
static inline void tile(const float* x, const float* xsum, int64_t K, const uint8_t* wr, float* total) {
  constexpr int per = static_cast<int>(Layout<T>::VALUES / 32);
  const int64_t groups = K / 32;
  Group G[per];
  for (int j = 0; j < per; ++j) G[j].m[0] = G[j].m[1] = 0.0f;
  float mins[R];
  for (int i = 0; i < R; ++i) mins[i] = 0.0f;
#if KVOS_AVX2
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
#else
  float acc[R];
  for (int i = 0; i < R; ++i) acc[i] = 0.0f;
#endif
  for (int64_t g0 = 0; g0 < groups; g0 += per) {
    decode_block<T>(wr + (g0 / per) * Layout<T>::BYTES, G);
    for (int j = 0; j < per; ++j) {
      const Group& Gj = G[j];
      const int64_t g = g0 + j;
#if KVOS_AVX2
      const __m256 v0 = widen(Gj.q), v1 = widen(Gj.q + 8), v2 = widen(Gj.q + 16), v3 = widen(Gj.q + 24);
      const __m256 s0 = _mm256_set1_ps(Gj.s[0]), s1 = _mm256_set1_ps(Gj.s[1]);
#endif
      for (int i = 0; i < R; ++i) {
        const float* xg = x + i * K + g * 32;
#if KVOS_AVX2
        const __m256 a = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xg + 8), _mm256_mul_ps(v0, _mm256_loadu_ps(xg)));
        const __m256 c =
            _mm256_fmadd_ps(v3, _mm256_loadu_ps(xg + 24), _mm256_mul_ps(v2, _mm256_loadu_ps(xg + 16)));
        acc[i] = _mm256_fmadd_ps(c, s1, _mm256_fmadd_ps(a, s0, acc[i]));
#else
        float a = 0.0f, c = 0.0f;
        for (int l = 0; l < 16; ++l) {
          a += static_cast<float>(Gj.q[l]) * xg[l];
          c += static_cast<float>(Gj.q[l + 16]) * xg[l + 16];
        }
        acc[i] += a * Gj.s[0] + c * Gj.s[1];
#endif
        if (Layout<T>::MIN)
          mins[i] += Gj.m[0] * xsum[(i * groups + g) * 2] + Gj.m[1] * xsum[(i * groups + g) * 2 + 1];
      }
    }
  }
#if KVOS_AVX2
  for (int i = 0; i < R; ++i) total[i] = hsum256(acc[i]) + mins[i];
#else
  for (int i = 0; i < R; ++i) total[i] = acc[i] + mins[i];
#endif
}

"""
    + ROW_PREFETCH
    + INT8_BLOCKS
    + INT8_PANELS
    + r"""

// total[i] = x_i . w_r for the R (<= 4) rows of quantized x (xq int8 [R, K], xd [R, groups], xh
// [R, groups, 2]): per half-group the integer dot product of the weights' q with x's, scaled by both
// scales, plus the mins.
template <int T, int R>
static inline void tile_i8(const int8_t* xq, const float* xd, const float* xh, int64_t K, const uint8_t* wr,
                           float* total) {
  constexpr int per = static_cast<int>(Layout<T>::VALUES / 32);
  const int64_t groups = K / 32;
  Group G[per];
  for (int j = 0; j < per; ++j) G[j].m[0] = G[j].m[1] = 0.0f;
  float mins[R];
  for (int i = 0; i < R; ++i) mins[i] = 0.0f;
#if KVOS_AVX2
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
#else
  float acc[R];
  for (int i = 0; i < R; ++i) acc[i] = 0.0f;
#endif
  for (int64_t g0 = 0; g0 < groups; g0 += per) {
    decode_block<T>(wr + (g0 / per) * Layout<T>::BYTES, G);
    for (int j = 0; j < per; ++j) {
      const Group& Gj = G[j];
      const int64_t g = g0 + j;
#if KVOS_AVX2
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(Gj.q));
      const __m256i u = _mm256_sign_epi8(w, w);  // |w|; x takes w's sign
      const __m256 sw = _mm256_setr_m128(_mm_set1_ps(Gj.s[0]), _mm_set1_ps(Gj.s[1]));
#endif
      for (int i = 0; i < R; ++i) {
        const int64_t b = i * groups + g;
#if KVOS_AVX2
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
        const __m256i x = _mm256_sign_epi8(xb, w);
        const __m256 p = _mm256_cvtepi32_ps(dot4(u, x));
        acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(sw, _mm256_set1_ps(xd[b])), acc[i]);
#else
        int32_t a = 0, c = 0;
        for (int l = 0; l < 16; ++l) {
          a += Gj.q[l] * xq[b * 32 + l];
          c += Gj.q[l + 16] * xq[b * 32 + l + 16];
        }
        acc[i] += static_cast<float>(a) * (Gj.s[0] * xd[b]) + static_cast<float>(c) * (Gj.s[1] * xd[b]);
#endif
        if (Layout<T>::MIN) mins[i] += Gj.m[0] * xh[2 * b] + Gj.m[1] * xh[2 * b + 1];
      }
    }
  }
#if KVOS_AVX2
  for (int i = 0; i < R; ++i) total[i] = hsum256(acc[i]) + mins[i];
#else
  for (int i = 0; i < R; ++i) total[i] = acc[i] + mins[i];
#endif
}

#if KVOS_VNNI512
// Unaligned loads of 16 bytes, and of 4 or 2 as the signed integers _mm_setr_epi32/16 take.
static inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
static inline int i32(const uint8_t* p) { return static_cast<int>(u32(p)); }
static inline int16_t i16(const uint8_t* p) { return static_cast<int16_t>(u16(p)); }

// Where a Q5_0 / Q5_1 block keeps its fields: scale d at 0 (Q5_1's min m at 2), the fifth bits qh (bit l of
// element l), then the 16 bytes of nibbles (element l's low nibble at byte l, element 16 + l's high one).
template <int Q>
struct Q5Fields {
  static constexpr int BYTES = static_cast<int>(Layout<Q>::BYTES), QS = Q == Q5_0 ? 6 : 8, QH = QS - 4;
};

// Four blocks of a row, as the tile reads them: the 64 bytes of their nibbles side by side; for each of those
// bytes the fifth bit of its low and of its high nibble, as masks; the four scales and (Q5_1) mins, float16.
struct Q5Chunk {
  __m512i w;
  __mmask64 lo, hi;
  __m128i d, m;
};

// Blocks [g, g + left) of row wr (left 1-4; the missing ones zero), field by field.
template <int Q>
static inline Q5Chunk q5_by_field(const uint8_t* wr, int64_t g, int64_t left) {
  constexpr int64_t BYTES = Q5Fields<Q>::BYTES, QS = Q5Fields<Q>::QS, QH = Q5Fields<Q>::QH;
  Q5Chunk k;
  __m128i qh;
  k.m = _mm_setzero_si128();
  if (left == 4) {  // four whole blocks: fixed offsets, no branch (every chunk of a row but its last)
    const uint8_t* b = wr + g * BYTES;
    const __m256i w01 = _mm256_setr_m128i(load16(b + QS), load16(b + BYTES + QS));
    k.w = _mm512_inserti32x4(_mm512_castsi256_si512(w01), load16(b + 2 * BYTES + QS), 2);
    k.w = _mm512_inserti32x4(k.w, load16(b + 3 * BYTES + QS), 3);
    qh = _mm_setr_epi32(i32(b + QH), i32(b + BYTES + QH), i32(b + 2 * BYTES + QH), i32(b + 3 * BYTES + QH));
    k.d = _mm_setr_epi16(i16(b), i16(b + BYTES), i16(b + 2 * BYTES), i16(b + 3 * BYTES), 0, 0, 0, 0);
    if (Q == Q5_1)
      k.m = _mm_setr_epi16(i16(b + 2), i16(b + BYTES + 2), i16(b + 2 * BYTES + 2), i16(b + 3 * BYTES + 2),
                           0, 0, 0, 0);
  } else {  // the row's last chunk, of 1-3 blocks, the rest zero
    alignas(64) uint8_t qs[64] = {};
    alignas(16) uint32_t qw[4] = {0, 0, 0, 0};
    alignas(16) uint16_t d[8] = {}, m[8] = {};
    for (int64_t j = 0; j < left; ++j) {
      const uint8_t* b = wr + (g + j) * BYTES;
      std::memcpy(qs + 16 * j, b + QS, 16);
      qw[j] = u32(b + QH);
      d[j] = u16(b);
      if (Q == Q5_1) m[j] = u16(b + 2);
    }
    k.w = _mm512_load_si512(qs);
    qh = _mm_load_si128(reinterpret_cast<const __m128i*>(qw));
    k.d = _mm_load_si128(reinterpret_cast<const __m128i*>(d));
    k.m = _mm_load_si128(reinterpret_cast<const __m128i*>(m));
  }
  // each qh word's low 16 bits, blocks 0..3 side by side (bytes 0, 1, 4, 5, ...), then its high 16 bits
  const __m128i halves = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m128i bits = _mm_shuffle_epi8(qh, halves);
  k.lo = _cvtu64_mask64(static_cast<uint64_t>(_mm_cvtsi128_si64(bits)));
  k.hi = _cvtu64_mask64(static_cast<uint64_t>(_mm_extract_epi64(bits, 1)));
  return k;
}

#if defined(__AVX512VBMI__)
// Byte indices into four whole blocks (88 / 96 bytes, two vectors) that gather them with byte permutes: `w`,
// the nibbles; `lo` / `hi`, for each nibble byte, the qh byte that holds its low / high nibble's fifth bit,
// and `bit` that bit; `dm`, the four scales (bytes 0-7) and mins (8-15).
template <int Q>
struct Q5Gather {
  static constexpr int BYTES = Q5Fields<Q>::BYTES, QS = Q5Fields<Q>::QS, QH = Q5Fields<Q>::QH;
  alignas(64) uint8_t w[64], lo[64], hi[64], bit[64], dm[64];
  constexpr Q5Gather() : w(), lo(), hi(), bit(), dm() {
    for (int j = 0; j < 64; ++j) {
      const int k = j / 16, i = j % 16;
      w[j] = static_cast<uint8_t>(k * BYTES + QS + i);
      lo[j] = static_cast<uint8_t>(k * BYTES + QH + i / 8);
      hi[j] = static_cast<uint8_t>(k * BYTES + QH + 2 + i / 8);
      bit[j] = static_cast<uint8_t>(1 << (i % 8));
    }
    for (int k = 0; k < 4; ++k)
      for (int b = 0; b < 2; ++b) {
        dm[2 * k + b] = static_cast<uint8_t>(k * BYTES + b);
        dm[8 + 2 * k + b] = static_cast<uint8_t>(k * BYTES + 2 + b);
      }
  }
};
template <int Q>
constexpr Q5Gather<Q> Q5_GATHER{};

// Four whole blocks from b: two loads (the second only to the fourth block's end) and byte permutes.
template <int Q>
static inline Q5Chunk q5_by_permute(const uint8_t* b) {
  const Q5Gather<Q>& G = Q5_GATHER<Q>;
  const __m512i v0 = _mm512_loadu_si512(b);
  const __m512i v1 = _mm512_maskz_loadu_epi8((__mmask64{1} << (4 * G.BYTES - 64)) - 1, b + 64);
  const __m512i bit = _mm512_load_si512(G.bit);
  Q5Chunk k;
  k.w = _mm512_permutex2var_epi8(v0, _mm512_load_si512(G.w), v1);
  k.lo = _mm512_test_epi8_mask(_mm512_permutex2var_epi8(v0, _mm512_load_si512(G.lo), v1), bit);
  k.hi = _mm512_test_epi8_mask(_mm512_permutex2var_epi8(v0, _mm512_load_si512(G.hi), v1), bit);
  k.d = _mm512_castsi512_si128(_mm512_permutex2var_epi8(v0, _mm512_load_si512(G.dm), v1));
  k.m = _mm_srli_si128(k.d, 8);
  return k;
}
#endif

// Blocks [g, g + 4) of row wr (fewer at the row's end): by byte permutes where the CPU has AVX512-VBMI and
// the four are whole (9,728 x 896 at one row of x in 186-196 us against 223-235 field by field, one Zen 5
// thread), else field by field.
template <int Q>
static inline Q5Chunk q5_chunk(const uint8_t* wr, int64_t g, int64_t left) {
#if defined(__AVX512VBMI__)
  if (left == 4) return q5_by_permute<Q>(wr + g * Q5Fields<Q>::BYTES);
#endif
  return q5_by_field<Q>(wr, g, left);
}

// total[i] = x_i . w_r for T rows of x laid out as Int8Chunks, w_r a row of Q5_0 or Q5_1 blocks, four blocks
// an iteration (q5_chunk): q = nibble + 16 * bit in 0..31; w = d * q + m with m = -16 d for Q5_0.
template <int T, int Q>
static inline void tile_q5_512(const Int8Chunks& xc, int64_t i0, int64_t groups, const uint8_t* wr,
                               float* total) {
  const int64_t stride = xc.chunks * 4;
  const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[T];
  __m128 macc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm512_setzero_ps(), macc[i] = _mm_setzero_ps();
  for (int64_t c = 0; c < xc.chunks; ++c) {
    const int64_t g = c * 4;
    const Q5Chunk k = q5_chunk<Q>(wr, g, std::min<int64_t>(4, groups - g));
    __m512i lo = _mm512_and_si512(k.w, low), hi = _mm512_and_si512(_mm512_srli_epi16(k.w, 4), low);
    lo = _mm512_mask_add_epi8(lo, k.lo, lo, fifth);
    hi = _mm512_mask_add_epi8(hi, k.hi, hi, fifth);
    const __m128 d4 = _mm_cvtph_ps(k.d);
    const __m128 m4 = Q == Q5_0 ? _mm_mul_ps(d4, _mm_set1_ps(-16.0f)) : _mm_cvtph_ps(k.m);
    for (int i = 0; i < T; ++i) {
      const int8_t* x = xc.q.data() + ((i0 + i) * xc.chunks + c) * 128;
      const float* xd = xc.d.data() + (i0 + i) * stride + g;
      const float* xs = xc.s.data() + (i0 + i) * stride + g;
      __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
      p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512(x + 64));
      const __m128 sc = _mm_mul_ps(d4, _mm_loadu_ps(xd));
      const __m512 lane_scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), lane_scales, acc[i]);
      macc[i] = _mm_fmadd_ps(m4, _mm_loadu_ps(xs), macc[i]);
    }
  }
  for (int i = 0; i < T; ++i) {
    __m128 h = _mm_add_ps(macc[i], _mm_movehl_ps(macc[i], macc[i]));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    total[i] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(h);
  }
}

// total[i] = x_i . w_r for T rows of x (Int8Rows), w_r a row of Q6_K super-blocks: each half of 128 values
// in two 64-byte vectors of 6-bit q (0..63: ql's low nibbles then its high ones, qh's 2-bit pairs shifted
// into bits 4-5), in the values' own order, so x is read as it lies. Lanes of four hold 16 values, one
// int8 sub-scale; w = d * sc * (q - 32), the -32 entering through x's sums of 16.
template <int T>
static inline void tile_q6k_512(const Int8Rows& xi, int64_t i0, int64_t K, const uint8_t* wr,
                                float* total) {
  const int64_t groups = K / 32, supers = K / 256;
  const __m512i low = _mm512_set1_epi8(0x0F), pair_bits = _mm512_set1_epi8(0x30);
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i spread_lo = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread_hi = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
  const __m256i twice = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);  // each group's scale for its two 16s
  __m512 acc_lo[T], acc_hi[T];
  __m256 macc[T];
  for (int i = 0; i < T; ++i) acc_lo[i] = acc_hi[i] = _mm512_setzero_ps(), macc[i] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* b = wr + sb * 210;
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m256i qh256 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m512i qh = _mm512_broadcast_i64x4(qh256);
      const __m512i q_lo = _mm512_or_si512(_mm512_and_si512(ql, low),
                                           _mm512_and_si512(_mm512_sllv_epi16(qh, up), pair_bits));
      const __m512i q_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                           _mm512_and_si512(_mm512_srlv_epi16(qh, down), pair_bits));
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h));
      const __m256 s8 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
      const int64_t g0 = sb * 8 + h * 4;
      for (int i = 0; i < T; ++i) {
        const int64_t row = i0 + i;
        const int8_t* x = xi.q.data() + row * K + g0 * 32;
        const __m512i p_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q_lo, _mm512_loadu_si512(x));
        const __m512i p_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q_hi, _mm512_loadu_si512(x + 64));
        const __m128 xd = _mm_loadu_ps(xi.d.data() + row * groups + g0);
        const __m256 sx = _mm256_mul_ps(s8, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(xd), twice));
        const __m512 sx512 = _mm512_castps256_ps512(sx);
        const __m512 s_lo = _mm512_permutexvar_ps(spread_lo, sx512);
        const __m512 s_hi = _mm512_permutexvar_ps(spread_hi, sx512);
        acc_lo[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_lo), s_lo, acc_lo[i]);
        acc_hi[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_hi), s_hi, acc_hi[i]);
        macc[i] = _mm256_fmadd_ps(s8, _mm256_loadu_ps(xi.h.data() + 2 * (row * groups + g0)), macc[i]);
      }
    }
  }
  for (int i = 0; i < T; ++i)
    total[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[i], acc_hi[i])) - 32.0f * hsum256(macc[i]);
}

// out[:, r0:r1] for every row of x, a Q6_K weight, four rows of x at a time.
static void mm_rows_q6k_512(const Int8Rows& xi, int64_t n, int64_t K, const uint8_t* w,
                            int64_t row_bytes, float* out, int64_t N, int64_t r0, int64_t r1, bool add) {
  each_tile(n, r0, r1, out, N, add, RowPrefetch(N).stream(w, row_bytes),
            [&](int64_t r, int64_t i0, auto rows, float* total) {
    tile_q6k_512<decltype(rows)::value>(xi, i0, K, w + r * row_bytes, total);
  });
}

// out[:, r0:r1] for every row of x (Int8Chunks), a Q5_0 or Q5_1 weight, four rows of x at a time.
template <int Q>
static void mm_rows_q5_512(const Int8Chunks& xc, int64_t n, int64_t K, const uint8_t* w,
                           int64_t row_bytes, float* out, int64_t N, int64_t r0, int64_t r1, bool add) {
  each_tile(n, r0, r1, out, N, add, RowPrefetch(N).stream(w, row_bytes),
            [&](int64_t r, int64_t i0, auto rows, float* total) {
    tile_q5_512<decltype(rows)::value, Q>(xc, i0, K / 32, w + r * row_bytes, total);
  });
}
#endif

#if KVOS_INT8_SIMD
// How a type's integers enter a panel (kvos/model/int8_panels.py): signed (the sign trick) or shifted by
// OFFSET into 0..63, and how many runs' 16-bit sums may be added before widening.
template <int T> struct PanelKind {
  static constexpr bool SIGNED = false;
  static constexpr int OFFSET = 0;   // Q5_1, Q5_K: unsigned already
  static constexpr int ADDS = 4;     // integers < 32
  static constexpr bool HALVES = false;
};
#define PANEL_KIND(T, S, O, A, H)            \
  template <> struct PanelKind<T> {          \
    static constexpr bool SIGNED = S;        \
    static constexpr int OFFSET = O;         \
    static constexpr int ADDS = A;           \
    static constexpr bool HALVES = H;        \
  };
PANEL_KIND(Q4_0, false, 8, 8, false)
PANEL_KIND(Q4_1, false, 0, 8, false)
PANEL_KIND(Q4_K, false, 0, 8, false)
PANEL_KIND(Q5_0, false, 16, 4, false)
PANEL_KIND(Q2_K, false, 0, 4, true)
PANEL_KIND(Q3_K, false, 4, 4, true)
PANEL_KIND(Q6_K, false, 32, 2, true)
PANEL_KIND(Q8_0, true, 0, 1, false)
PANEL_KIND(IQ4_NL, true, 0, 1, false)
PANEL_KIND(IQ4_XS, true, 0, 1, false)

// out[:, panels p0..p1 (8 weight rows each)] for every row of quantized x: each panel decoded once.
template <int T>
static void mm_panels(const Int8Rows& xi, int64_t n, int64_t K, const uint8_t* w, int64_t row_bytes,
                      float* out, int64_t N, int64_t p0, int64_t p1, bool add) {
  using P = PanelKind<T>;
  constexpr int per = static_cast<int>(Layout<T>::VALUES / 32);
  Group G[per];
  for (int j = 0; j < per; ++j) G[j].m[0] = G[j].m[1] = 0.0f;
  auto fill = [&](Panel& panel, int64_t r0, int rows) {
    for (int r = 0; r < rows; ++r) {
      const uint8_t* wr = w + (r0 + r) * row_bytes;
      for (int64_t g0 = 0; g0 < K / 32; g0 += per) {
        decode_block<T>(wr + (g0 / per) * Layout<T>::BYTES, G);
        for (int j = 0; j < per; ++j) panel.set(r, g0 + j, G[j].q, G[j].s, G[j].m);
      }
    }
    panel.finish(rows, P::OFFSET);
  };
  panels_product<P::SIGNED, P::ADDS, P::HALVES, !P::SIGNED>(xi, n, K, out, N, p0, p1, add, fill);
}
#endif

// out[:, r0:r1] for every row of quantized x, four rows of x at a time.
template <int T>
static void mm_rows_i8(const int8_t* xq, const float* xd, const float* xh, int64_t n, int64_t K,
                       const uint8_t* w, int64_t row_bytes, float* out, int64_t N, int64_t r0, int64_t r1,
                       bool add) {
  const int64_t groups = K / 32;
  each_tile(n, r0, r1, out, N, add, RowPrefetch(N).stream(w, row_bytes),
            [&](int64_t r, int64_t i0, auto rows, float* total) {
    const int64_t o = i0 * groups;
    tile_i8<T, decltype(rows)::value>(xq + o * 32, xd + o, xh + 2 * o, K, w + r * row_bytes, total);
  });
}

// out[:, r0:r1] for every row of x, four rows of x at a time.
template <int T>
static void mm_rows(const float* x, const float* xsum, int64_t n, int64_t K, const uint8_t* w,
                    int64_t row_bytes, float* out, int64_t N, int64_t r0, int64_t r1, bool add) {
  const int64_t groups = K / 32;
  each_tile(n, r0, r1, out, N, add, RowPrefetch(N).stream(w, row_bytes),
            [&](int64_t r, int64_t i0, auto rows, float* total) {
    tile<T, decltype(rows)::value>(x + i0 * K, xsum + i0 * groups * 2, K, w + r * row_bytes, total);
  });
}

template <int T>
static void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t r0,
                            int64_t r1) {
  constexpr int per = static_cast<int>(Layout<T>::VALUES / 32);
  Group G[per];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    for (int64_t g0 = 0; g0 < K / 32; g0 += per) {
      decode_block<T>(wr + (g0 / per) * Layout<T>::BYTES, G);
      for (int j = 0; j < per; ++j) {
        float* o = out + r * K + (g0 + j) * 32;
        for (int l = 0; l < 32; ++l) {
          const float v = G[j].s[l / 16] * static_cast<float>(G[j].q[l]);
          o[l] = Layout<T>::MIN ? v + G[j].m[l / 16] : v;
        }
      }
    }
  }
}

template <int T>
static int64_t row_bytes_of(int64_t K) {
  TORCH_CHECK(K % Layout<T>::VALUES == 0, "the row length is not a whole number of blocks");
  return K / Layout<T>::VALUES * Layout<T>::BYTES;
}

#define KVOS_DISPATCH(type, CALL)                                    \
  switch (type) {                                                    \
    case Q4_0: { constexpr int T = Q4_0; CALL; break; }              \
    case Q4_1: { constexpr int T = Q4_1; CALL; break; }              \
    case Q5_0: { constexpr int T = Q5_0; CALL; break; }              \
    case Q5_1: { constexpr int T = Q5_1; CALL; break; }              \
    case Q8_0: { constexpr int T = Q8_0; CALL; break; }              \
    case Q2_K: { constexpr int T = Q2_K; CALL; break; }              \
    case Q3_K: { constexpr int T = Q3_K; CALL; break; }              \
    case Q4_K: { constexpr int T = Q4_K; CALL; break; }              \
    case Q5_K: { constexpr int T = Q5_K; CALL; break; }              \
    case Q6_K: { constexpr int T = Q6_K; CALL; break; }              \
    case IQ4_NL: { constexpr int T = IQ4_NL; CALL; break; }          \
    case IQ4_XS: { constexpr int T = IQ4_XS; CALL; break; }          \
    default: TORCH_CHECK(false, "unknown GGUF type id ", type);      \
  }

// c [n, N] (or empty) + x [n, K] float32 @ w.T -> [n, N] float32; w uint8 [N, row_bytes] of blocks of `type`.
torch::Tensor mm(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor c) {
  const int64_t n = x.size(0), K = x.size(1), N = w.size(0), groups = K / 32;
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x must be contiguous float32");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8, "w must be contiguous uint8");
  int64_t rb = 0;
  KVOS_DISPATCH(type, rb = row_bytes_of<T>(K));
  TORCH_CHECK(w.size(1) == rb, "x's columns do not match the weight's rows");
  const bool add = c.numel() > 0;
  TORCH_CHECK(!add || (c.is_contiguous() && c.scalar_type() == torch::kFloat32 && c.size(0) == n &&
                       c.size(1) == N), "c must be contiguous float32 [n, N]");
  auto out = add ? c.clone() : torch::empty({n, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(n * groups * 2);  // each half-group's sum of x, for the mins
  for (size_t b = 0; b < xsum.size(); ++b) {
    float acc = 0.0f;
    for (int64_t j = 0; j < 16; ++j) acc += xp[b * 16 + j];
    xsum[b] = acc;
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    KVOS_DISPATCH(type, mm_rows<T>(xp, xsum.data(), n, K, wp, rb, op, N, r0, r1, add));
  });
  return out;
}

// As mm, with x quantized to int8 blocks first (quantize_blocks) and integer products: what llama.cpp
// computes for these weights, by the tiles or the panels (Path, kvos/model/int8_panels.py).
static torch::Tensor product_i8(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor c, Path path) {
  const int64_t n = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x must be contiguous float32");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8, "w must be contiguous uint8");
  int64_t rb = 0;
  KVOS_DISPATCH(type, rb = row_bytes_of<T>(K));
  TORCH_CHECK(w.size(1) == rb, "x's columns do not match the weight's rows");
  const bool add = c.numel() > 0;
  TORCH_CHECK(!add || (c.is_contiguous() && c.scalar_type() == torch::kFloat32 && c.size(0) == n &&
                       c.size(1) == N), "c must be contiguous float32 [n, N]");
  auto out = add ? c.clone() : torch::empty({n, N}, x.options());
  const Int8Rows xi(x.data_ptr<float>(), n, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
#if KVOS_INT8_SIMD
  if (takes_panels(path, n, type)) {
    at::parallel_for(0, (N + PANEL - 1) / PANEL, 1, [&](int64_t p0, int64_t p1) {
      KVOS_DISPATCH(type, mm_panels<T>(xi, n, K, wp, rb, op, N, p0, p1, add));
    });
    return out;
  }
#endif
#if KVOS_VNNI512
  if (type == Q5_0 || type == Q5_1) {
    const Int8Chunks xc(xi, n, K / 32);
    at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
      if (type == Q5_0) mm_rows_q5_512<Q5_0>(xc, n, K, wp, rb, op, N, r0, r1, add);
      else mm_rows_q5_512<Q5_1>(xc, n, K, wp, rb, op, N, r0, r1, add);
    });
    return out;
  }
  if (type == Q6_K) {
    at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
      mm_rows_q6k_512(xi, n, K, wp, rb, op, N, r0, r1, add);
    });
    return out;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    const int8_t* q = xi.q.data();
    KVOS_DISPATCH(type, mm_rows_i8<T>(q, xi.d.data(), xi.h.data(), n, K, wp, rb, op, N, r0, r1, add));
  });
  return out;
}

torch::Tensor mm_i8(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor c) {
  return product_i8(x, w, type, c, AUTO);
}

// mm_i8 by one path (where the CPU has the integer SIMD for panels; tests and benchmarks).
torch::Tensor mm_i8_tiles(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor c) {
  return product_i8(x, w, type, c, TILES);
}

torch::Tensor mm_i8_panels(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor c) {
  return product_i8(x, w, type, c, PANELS);
}

// The rows of w as float32 [N, K].
torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8, "w must be contiguous uint8");
  const int64_t N = w.size(0);
  int64_t rb = 0;
  KVOS_DISPATCH(type, rb = row_bytes_of<T>(K));
  TORCH_CHECK(w.size(1) == rb, "the rows are not K values of this type");
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    KVOS_DISPATCH(type, dequantize_rows<T>(wp, rb, K, op, r0, r1));
  });
  return out;
}

// The products by address, for the step kernel (kvos/model/step_kernel.py): out = c + x @ W.T with the
// weight's rows t = {raw} and its type id as `arg`, the call kvos.model.quant.NativePart describes.
static torch::Tensor entry_i8(const torch::Tensor& x, const std::vector<torch::Tensor>& t, int64_t arg,
                              const torch::Tensor& c) {
  return mm_i8(x, t[0], arg, c);
}

static torch::Tensor entry_f32(const torch::Tensor& x, const std::vector<torch::Tensor>& t, int64_t arg,
                               const torch::Tensor& c) {
  return mm(x, t[0], arg, c);
}

// Whether this build multiplies Q5_0/Q5_1 rows with int8 activations chunk by chunk in 512-bit registers
// (AVX512-VNNI): without that path a Q5_0 row decodes slower than the same values as 8-bit groups, and the
// loader repacks them (kvos/model/gguf.py, repacks_q5_0).
bool has_q5_chunks() {
#if KVOS_VNNI512
  return true;
#else
  return false;
#endif
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
    "has_panels",
    "has_q5_chunks",
    "set_panel_rows",
    "panel_rows_of",
    "set_prefetch_level",
    "prefetch_level_of",
    "dequantize",
]
NAME = "kvos_gguf_v9"  # the build's name (and its cache directory's)


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why), set
    to this machine's level for where its decode products' rows asked for ahead go (``row_prefetch``)."""
    return row_prefetch.apply(build(NAME, _SOURCE, FUNCTIONS, ["-O3", "-march=native"], "gguf.quants"))


@functools.cache
def portable_kernel() -> Any | None:
    """The same kernels built without SIMD intrinsics (the path of a CPU without AVX2/FMA/F16C), for tests."""
    return build("kvos_gguf_portable_v9", _SOURCE, FUNCTIONS, ["-O3", "-DKVOS_PORTABLE"], "gguf.quants")


@functools.cache
def no_vbmi_kernel() -> Any | None:
    """The kernels this CPU builds without AVX512-VBMI (the path of an AVX-512 CPU without it, such as an
    Intel Xeon before Ice Lake: Q5_0/Q5_1 blocks gathered field by field), for tests on a CPU with it."""
    flags = ["-O3", "-march=native", "-mno-avx512vbmi"]
    return build("kvos_gguf_novbmi_v9", _SOURCE, FUNCTIONS, flags, "gguf.quants")


@functools.cache
def avx2_kernel() -> Any | None:
    """The kernels this CPU builds without AVX-512 (the path of an AVX2 CPU such as AMD Zen 3), for tests on a
    CPU with AVX-512."""
    flags = ["-O3", "-march=native", "-mno-avx512f"]
    return build("kvos_gguf_avx2_v9", _SOURCE, FUNCTIONS, flags, "gguf.quants")
