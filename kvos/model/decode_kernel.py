"""A CPU kernel for decode attention read straight from the paged pool.

``attend(q, k, v, slots, lengths, key_positions, positions, window, probs, hk, hv, head_codes, parts)``
computes the attention of one new token per sequence for B sequences at once, each over its own cached keys,
without gathering them:

- q float32 [B, H, D] (the new tokens' queries, RoPE applied; its heads contiguous, its rows may lie apart, as
  in the fused projection's output);
- k, v float32 or float16 [S, Hkv, D]: one layer of the pool seen as flat slots (its own storage, not a copy;
  float16 values are widened as they are loaded, F16C's ``vcvtph2ps``, and every sum is float32);
- slots int64 [B, T]: each sequence's slots in cache order, padded to the longest; lengths int64 [B];
- key_positions int64 [B, T] and positions int64 [B]: a key is seen when its position is at or before the
  query's and, with ``window`` > 0 (a sliding-window layer), after ``position - window``;
- probs float32 [B, H, T], or empty: filled with each sequence's attention probabilities (for the memory
  policy's attention signal) where given;
- hk, hv [R, D] (the pool's head store, same dtype as k) and head_codes int64 [B, Hkv, T], or all three
  empty: where some of a sequence's tokens are kept per KV head (:class:`~kvos.model.attention.HeadKeys`),
  the code of each (sequence, KV head, key) says where that head reads it: ``>= 0`` a head-store slot, ``-1``
  the pool at ``slots`` (a whole token), ``-2`` nowhere (the head dropped it: unseen, probability 0);
- parts: how many runs each (sequence, KV head) task's keys are split into, merged by their largest scores
  (flash decoding's split); 0 lets the kernel choose: two runs a thread where there are fewer tasks than
  that (one sequence of SmolLM2-135M has 3 KV heads; two threads then idle a third of the time), each of
  256 keys or more. 4,096 keys, two threads: 110 us a layer whole, 92 split.

Returns float32 [B, H * D]. Query head ``i`` reads KV head ``i // (H / Hkv)`` (grouped-query attention).
Each (sequence, KV head) pair is one task of ``at::parallel_for``: it lists the rows of the keys its query
sees (so nothing after is masked), and its G query heads go over them 16 rows at a time, so that a tile is
read from memory once and from L1 by the other heads, the rows four tiles ahead asked for meanwhile (a
head's rows lie a slot apart, which the hardware's prefetchers did not follow: 7 GB/s): scores eight keys at
a time (their sums reduced together), a softmax with an AVX2 exponential (Cephes' range reduction and
polynomial), then the values weighted into output floats held in registers. With AVX-512 and head dims of
64 or 128, 512-bit vectors: the scores of up to three heads from one pass over the keys and the values of
up to four heads (two at 128) summed in one pass, each row widened once a pass (one head's scores a pass
widened every key three times over for SmolLM2-135M: its 4,096-key layer 216 -> 180 us warm, one thread on
an AMD Zen 4). SmolLM2-135M's shape over 4,096 keys, one thread, each layer's pool cold as in a decode step:
431 us a layer before these, 158 after (docs/benchmarks.md). The gathered path it replaces copied every
sequence's K/V out of the pool at every layer of every decode step (``index_select``) before two batched
products. On the 0.5B shape (14 query heads, 2 KV heads of 64) one layer's attention of 8 sequences of 600
keys took 0.34 ms against 0.62-0.76 ms gathered; a decode step of 8 sequences 145 ms against 165 at 600
keys and 218 ms against 333 at 3,000 (docs/benchmarks.md).

The module also holds two small steps a session takes after every decoded token, in C++ because the Python
that runs after a decode step finds every cache cold (the step streamed the weights through them), where
each numpy or torch call costs ~10x its warm time: ``chunk_masses(probs, bounds)``, the attention signal's
mass per resident chunk from the captured layers' probabilities
(:func:`kvos.policy.attention.chunk_mass_list`), and ``observe_masses``, the same masses written straight
into an attention tracker's rows (:meth:`kvos.policy.attention.AttentionTracker.observe_probs`);
``log_normaliser(logits)``, the log sum exp a token's log-probability needs
(:func:`kvos.engine.sampling.log_normaliser`), and ``row_stats`` (:mod:`kvos.engine.logit_stats`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvos.extensions import build
from kvos.model.attention import DecodeGroup
from kvos.model.dtype import KERNEL_KV_DTYPES
from kvos.model.simd_exp import SOURCE as EXP8

EMPTY = torch.empty(0)

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <c10/util/Half.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX2 1
#if defined(__AVX512F__)
#define KVOS_AVX512 1  // head dims of 64 and 128 in 512-bit vectors
#endif
#endif
"""
    + EXP8
    + r"""
// The pool holds float32 or float16 (E); every sum is in float32.
static inline float to_f(float x) { return x; }
static inline float to_f(c10::Half x) { return static_cast<float>(x); }
#if KVOS_AVX2
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// a . b over n values, in 8 running sums (vectorised by the compiler, no fast-math needed). Every product
// is fused with its sum (std::fma), as the AVX paths fuse them: whether the compiler contracts a * b + c
// depends on how it vectorises each element type, and a float16 pool must give what its float32 widening
// does.
template <typename E>
static inline float dot(const float* a, const E* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) acc[l] = std::fma(a[d + l], to_f(b[d + l]), acc[l]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) s = std::fma(a[d], to_f(b[d]), s);
  return s;
}

#if KVOS_AVX2
// The sums of eight vectors, as one vector: [sum r0, ..., sum r7].
static inline __m256 sums8(const __m256* r) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// s[i] = scale * q . k_i for the m keys at rows[i] (D values each).
template <typename E>
static void scores_of(const float* q, const E* const* rows, int64_t m, int64_t D, float scale, float* s) {
  int64_t i = 0;
#if KVOS_AVX2
  if (D % 8 == 0) {
    for (; i + 8 <= m; i += 8) {  // eight keys at once: their sums reduce together, no per-key reduction
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(rows[i + j] + d), acc[j]);
      }
      _mm256_storeu_ps(s + i, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; i < m; ++i) s[i] = dot(q, rows[i], D) * scale;
}

// s[i] <- exp(s[i] - max s) over m floats; returns their sum, the max in top.
static float exp_normalised(float* s, int64_t m, float& top) {
  top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if KVOS_AVX2
  __m256 tops = _mm256_set1_ps(top);  // the largest score eight lanes at a time (a scalar max is a chain)
  for (; i + 8 <= m; i += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(s + i));
  float lane[8];
  _mm256_storeu_ps(lane, tops);
  for (float x : lane) top = std::max(top, x);
#endif
  for (; i < m; ++i) top = std::max(top, s[i]);
  i = 0;
  float sum = 0.0f;
#if KVOS_AVX2
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (; i + 8 <= m; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  for (float x : lanes) sum += x;
#endif
  for (; i < m; ++i) {
    s[i] = std::exp(s[i] - top);
    sum += s[i];
  }
  return sum;
}

// o += sum_i p[i] v_i over the m values at rows[i] (D values each).
template <typename E>
static void weighted_sum(const float* p, const E* const* rows, int64_t m, int64_t D, float* o) {
  int64_t d = 0;
#if KVOS_AVX2
  for (; d + 64 <= D; d += 64) {  // 64 floats of o in registers while every value row passes
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(o + d + 8 * c);
    for (int64_t i = 0; i < m; ++i) {
      const __m256 w = _mm256_set1_ps(p[i]);
      const E* v = rows[i] + d;
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + d + 8 * c, acc[c]);
  }
#endif
  for (int64_t i = 0; i < m && d < D; ++i)
    for (int64_t e = d; e < D; ++e) o[e] = std::fma(p[i], to_f(rows[i][e]), o[e]);  // fused, as above
}

#if KVOS_AVX512
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// s[g * stride + j] = scale * q_g . k_j for NH query heads (q_g at q + g * 16 V) and the 8 keys at
// rows[0..8) of 16 V values: each key slice loaded (and widened) once for all NH heads, a 512-bit sum a
// (head, key), folded to 256 bits, a head's eight reduced together.
template <int V, int NH, typename E>
static inline void scores8_heads_512(const float* q, const E* const* rows, float scale, float* s,
                                     int64_t stride) {
  __m512 acc[NH][8];
  for (int g = 0; g < NH; ++g)
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int v = 0; v < V; ++v) {
    __m512 qv[NH];
    for (int g = 0; g < NH; ++g) qv[g] = _mm512_loadu_ps(q + g * 16 * V + 16 * v);
    for (int j = 0; j < 8; ++j) {
      const __m512 key = load16(rows[j] + 16 * v);
      for (int g = 0; g < NH; ++g) acc[g][j] = _mm512_fmadd_ps(qv[g], key, acc[g][j]);
    }
  }
  for (int g = 0; g < NH; ++g) {
    __m256 folded[8];
    for (int j = 0; j < 8; ++j) {
      const __m256 top = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[g][j]), 1));
      folded[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[g][j]), top);
    }
    _mm256_storeu_ps(s + g * stride, _mm256_mul_ps(sums8(folded), _mm256_set1_ps(scale)));
  }
}

// o + g * D (g < NH) += sum_i p[g * stride + i] v_i over the m value rows at rows[i] of D = 16 V values:
// the NH heads' outputs in 16 registers while every row passes, each row loaded (and widened) once.
template <int V, int NH, typename E>
static inline void values_512(const float* p, int64_t stride, const E* const* rows, int64_t m, float* o) {
  constexpr int64_t D = 16 * V;
  __m512 acc[NH][V];
  for (int g = 0; g < NH; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_loadu_ps(o + g * D + 16 * v);
  for (int64_t i = 0; i < m; ++i) {
    __m512 row[V];
    for (int v = 0; v < V; ++v) row[v] = load16(rows[i] + 16 * v);
    for (int g = 0; g < NH; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride + i]);
      for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(w, row[v], acc[g][v]);
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + g * D + 16 * v, acc[g][v]);
}
#endif

// s[g * stride + i] = scale * q_g . k_i for the G query heads of one KV head (q_g at q + g * D, contiguous)
// and the m keys at rows[i]: with 512 bits and head dims of 64 or 128, eight keys at a time for up to three
// heads a pass (their 24 sums in registers), each key widened once a pass instead of once a head.
template <typename E>
static inline void tile_scores_heads(const float* q, const E* const* rows, int64_t m, int64_t D, int64_t G,
                                     float scale, float* s, int64_t stride) {
#if KVOS_AVX512
  if (D == 64 || D == 128) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
      for (int64_t g = 0; g < G; g += 3) {
        const float* qg = q + g * D;
        float* sg = s + g * stride + i;
        switch ((D == 64 ? 10 : 20) + std::min<int64_t>(3, G - g)) {
          case 11: scores8_heads_512<4, 1>(qg, rows + i, scale, sg, stride); break;
          case 12: scores8_heads_512<4, 2>(qg, rows + i, scale, sg, stride); break;
          case 13: scores8_heads_512<4, 3>(qg, rows + i, scale, sg, stride); break;
          case 21: scores8_heads_512<8, 1>(qg, rows + i, scale, sg, stride); break;
          case 22: scores8_heads_512<8, 2>(qg, rows + i, scale, sg, stride); break;
          default: scores8_heads_512<8, 3>(qg, rows + i, scale, sg, stride); break;
        }
      }
    for (; i < m; ++i)
      for (int64_t g = 0; g < G; ++g) s[g * stride + i] = dot(q + g * D, rows[i], D) * scale;
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) scores_of(q + g * D, rows, m, D, scale, s + g * stride);
}

// o + g * D (g < G) += sum_i p[g * stride + i] v_i over the m value rows at rows[i] (D values each):
// 512-bit for head dims of 64 (four heads a pass) and 128 (two).
template <typename E>
static inline void tile_values(const float* p, int64_t stride, const E* const* rows, int64_t m, int64_t D,
                               int64_t G, float* o) {
#if KVOS_AVX512
  if (D == 64 || D == 128) {
    const int64_t per = D == 64 ? 4 : 2;
    for (int64_t g = 0; g < G; g += per) {
      const float* pg = p + g * stride;
      float* og = o + g * D;
      switch ((D == 64 ? 10 : 20) + std::min(per, G - g)) {
        case 11: values_512<4, 1>(pg, stride, rows, m, og); break;
        case 12: values_512<4, 2>(pg, stride, rows, m, og); break;
        case 13: values_512<4, 3>(pg, stride, rows, m, og); break;
        case 14: values_512<4, 4>(pg, stride, rows, m, og); break;
        case 21: values_512<8, 1>(pg, stride, rows, m, og); break;
        default: values_512<8, 2>(pg, stride, rows, m, og); break;
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) weighted_sum(p + g * stride, rows, m, D, o + g * D);
}

// Ask for the m rows at rows[] (D values each) to be brought into the cache: the next tile's, while this
// one is computed. A head's rows lie a slot apart in the pool, in the order its page table gives, which the
// hardware's prefetchers do not follow far enough: without it, attention over 4,096 keys read 7 GB/s.
template <typename E>
static inline void ask_for(const E* const* rows, int64_t m, int64_t D) {
#if KVOS_AVX2
  const int64_t bytes = D * static_cast<int64_t>(sizeof(E));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[i]) + o, _MM_HINT_T0);
#else
  (void)rows, (void)m, (void)D;
#endif
}

// What a run over part of a task's keys leaves for each of its G query heads: the largest score, the sum of
// exp(score - largest) over its keys, and the values weighted by those exps (not yet divided by the sum).
struct Partial {
  float* o;    // [G, D]
  float* top;  // [G]
  float* sum;  // [G]
};

// One (sequence b, KV head h) task's keys [t0, t1): the G query heads that read KV head h, over those of
// the keys the query sees, into part; probs (where given) gets each seen key's exp(score - part's largest).
template <typename E>
static void attend_part(const float* q, int64_t q_row, const E* k, const E* v, const int64_t* slots,
                        const int64_t* kpos, int64_t qpos, int64_t t0, int64_t t1, int64_t window, int64_t H,
                        int64_t Hkv, int64_t D, int64_t T, int64_t b, int64_t h, Partial part, float* probs,
                        const E* hk, const E* hv, const int64_t* codes) {
  const int64_t G = H / Hkv, n = t1 - t0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<int64_t> seen(n);  // which of the keys the query sees, in cache order: the first m
  std::vector<const E*> krows(n), vrows(n);
  int64_t m = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t p = kpos[t];
    const int64_t code = codes ? codes[t] : -1;  // where this head reads the key (see the module's doc)
    if (code == -2 || p > qpos || (window > 0 && p <= qpos - window)) continue;
    seen[m] = t;
    krows[m] = code >= 0 ? hk + code * D : k + (slots[t] * Hkv + h) * D;
    vrows[m] = code >= 0 ? hv + code * D : v + (slots[t] * Hkv + h) * D;
    ++m;
  }
  // the G query heads go over the keys (then the values) a tile at a time, which stays in L1 for all of them
  constexpr int64_t TILE = 16, AHEAD = 4 * TILE;
  std::vector<float> s(G * m);
  ask_for(krows.data(), std::min(AHEAD, m), D);
  for (int64_t i0 = 0; i0 < m; i0 += TILE) {
    if (i0 + AHEAD < m) ask_for(krows.data() + i0 + AHEAD, std::min(TILE, m - i0 - AHEAD), D);
    tile_scores_heads(q + b * q_row + h * G * D, krows.data() + i0, std::min(TILE, m - i0), D, G, scale,
                      s.data() + i0, m);
  }
  ask_for(vrows.data(), std::min(AHEAD, m), D);
  std::fill_n(part.o, G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) part.sum[g] = exp_normalised(s.data() + g * m, m, part.top[g]);
  for (int64_t i0 = 0; i0 < m; i0 += TILE) {
    if (i0 + AHEAD < m) ask_for(vrows.data() + i0 + AHEAD, std::min(TILE, m - i0 - AHEAD), D);
    tile_values(s.data() + i0, m, vrows.data() + i0, std::min(TILE, m - i0), D, G, part.o);
  }
  for (int64_t g = 0; probs && g < G; ++g)
    for (int64_t i = 0; i < m; ++i) probs[(b * H + h * G + g) * T + seen[i]] = s[g * m + i];
}

// A task's S parts (part p over keys [bounds[p], bounds[p + 1])) merged: each part's exps rescaled to the
// largest score of all, o = sum_p o_p exp(top_p - top) / sum_p sum_p exp(top_p - top), written to out
// [G, D] and the probabilities rescaled likewise. A query that sees no key keeps zeros.
static void merge(const Partial* parts, const int64_t* bounds, int64_t S, int64_t G, int64_t D, int64_t T,
                  float* out, float* probs) {
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity(), total = 0.0f;
    for (int64_t p = 0; p < S; ++p) top = std::max(top, parts[p].top[g]);
    std::vector<float> factor(S, 0.0f);
    for (int64_t p = 0; p < S; ++p) {
      factor[p] = parts[p].sum[g] == 0.0f ? 0.0f : std::exp(parts[p].top[g] - top);  // NaN stays NaN
      total += parts[p].sum[g] * factor[p];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float* o = out + g * D;
    for (int64_t p = 0; p < S; ++p) {
      const float f = factor[p] * inv;
      const float* op = parts[p].o + g * D;
      if (p == 0)
        for (int64_t d = 0; d < D; ++d) o[d] = op[d] * f;
      else
        for (int64_t d = 0; d < D; ++d) o[d] += op[d] * f;
      for (int64_t t = bounds[p]; probs && t < bounds[p + 1]; ++t) probs[g * T + t] *= f;
    }
  }
}

// How many parts each of `tasks` tasks of up to n keys is split into: enough for two per thread where there
// are fewer tasks than that (one sequence of a model with few KV heads), each at least MIN_PART keys.
static int64_t parts_of(int64_t tasks, int64_t n, int64_t wanted) {
  constexpr int64_t MIN_PART = 256;
  if (wanted > 0) return std::max<int64_t>(1, std::min(wanted, n));
  if (tasks == 0) return 1;  // an empty batch
  const int64_t threads = at::get_num_threads();
  const int64_t parts = (2 * threads + tasks - 1) / tasks;
  return std::max<int64_t>(1, std::min(parts, n / MIN_PART));
}

template <typename E>
static void attend_all(const float* qp, int64_t q_row, const E* kp, const E* vp, const int64_t* sl,
                       const int64_t* len, const int64_t* kpp, const int64_t* qpp, int64_t window, int64_t B,
                       int64_t H, int64_t Hkv, int64_t D, int64_t T, float* op, float* pp, const E* hk,
                       const E* hv, const int64_t* codes, int64_t wanted) {
  const int64_t G = H / Hkv, tasks = B * Hkv;
  const int64_t S = parts_of(tasks, B > 0 ? *std::max_element(len, len + B) : 0, wanted);
  // each part's top [G], sum [G] and o [G, D]; with one part a task's o is its rows of out
  const int64_t floats = G * (2 + (S == 1 ? 0 : D));
  std::vector<float> scratch(tasks * S * floats);
  std::vector<Partial> parts(tasks * S);
  std::vector<int64_t> bounds(tasks * (S + 1));
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / Hkv, h = task % Hkv;
    for (int64_t p = 0; p <= S; ++p) bounds[task * (S + 1) + p] = len[b] * p / S;
    for (int64_t p = 0; p < S; ++p) {
      float* base = scratch.data() + (task * S + p) * floats;
      parts[task * S + p] = {S == 1 ? op + (b * H + h * G) * D : base + 2 * G, base, base + G};
    }
  }
  if (pp) std::fill_n(pp, B * H * T, 0.0f);
  at::parallel_for(0, tasks * S, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t task = i / S, p = i % S, b = task / Hkv, h = task % Hkv;
      const int64_t* kb = bounds.data() + task * (S + 1);
      attend_part<E>(qp, q_row, kp, vp, sl + b * T, kpp + b * T, qpp[b], kb[p], kb[p + 1], window, H, Hkv, D,
                     T, b, h, parts[i], pp, hk, hv, codes ? codes + task * T : nullptr);
    }
  });
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / Hkv, h = task % Hkv;
    merge(parts.data() + task * S, bounds.data() + task * (S + 1), S, G, D, T, op + (b * H + h * G) * D,
          pp ? pp + (b * H + h * G) * T : nullptr);
  }
}

// The sum of p[0, n) in double: sixteen running sums (four vectors of four) where AVX2 is built, so that the
// adds do not wait on each other; the scalar tail, and the portable build, one sum in order.
static double sum_in_double(const float* p, int64_t n) {
  double total = 0.0;
  int64_t j = 0;
#if KVOS_AVX2
  if (n >= 16) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (; j + 16 <= n; j += 16)
      for (int k = 0; k < 4; ++k)
        acc[k] = _mm256_add_pd(acc[k], _mm256_cvtps_pd(_mm_loadu_ps(p + j + 4 * k)));
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
    total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
#endif
  for (; j < n; ++j) total += p[j];
  return total;
}

// The attention signal's per-chunk masses of one decode step (kvos/policy/attention.py, chunk_mass_list):
// chunk c's mass is the mean over every row of every probs [heads, T] (the captured layers' heads) of the
// row's sum over keys [bounds[c], bounds[c + 1]), in double, clamped at 0. Rows may lie apart (a row stride),
// each row's keys contiguous.
std::vector<double> chunk_masses(std::vector<torch::Tensor> probs, std::vector<int64_t> bounds) {
  TORCH_CHECK_VALUE(!probs.empty() && bounds.size() >= 1 && bounds.front() == 0,
                    "chunk_masses: rows and boundaries [0, ..., T] wanted");
  for (size_t c = 1; c < bounds.size(); ++c)
    TORCH_CHECK_VALUE(bounds[c] >= bounds[c - 1], "chunk_masses: boundaries must be non-decreasing");
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<double> out(chunks, 0.0);
  int64_t rows = 0;
  for (const auto& p : probs) {
    TORCH_CHECK_VALUE(p.dim() == 2 && p.scalar_type() == torch::kFloat32 && p.device().is_cpu() &&
                          p.size(1) == bounds.back() && (p.size(1) <= 1 || p.stride(1) == 1),
                      "chunk_masses: each probs must be float32 [heads, T] on the CPU, T the last boundary");
    const float* base = p.data_ptr<float>();
    for (int64_t h = 0; h < p.size(0); ++h, ++rows) {
      const float* row = base + h * p.stride(0);
      for (int64_t c = 0; c < chunks; ++c)
        out[c] += sum_in_double(row + bounds[c], bounds[c + 1] - bounds[c]);
    }
  }
  for (auto& m : out) m = rows > 0 ? std::max(m / static_cast<double>(rows), 0.0) : 0.0;
  return out;
}

// One decode step's attention signal recorded into an attention tracker's rows
// (kvos.policy.attention.AttentionTracker): chunk i's mass as chunk_masses gives it, then, in row rows[i],
// values[row, seen[row] % depth] = mass (cumulative: values[row, 0] += mass) and seen[row] += 1. values:
// float64 [R, depth], seen: int64 [R], rows: int64 [chunks], distinct. When some mass is not finite (a NaN or
// infinite probability), records nothing and returns that chunk's index; else -1.
int64_t observe_masses(std::vector<torch::Tensor> probs, std::vector<int64_t> bounds, torch::Tensor values,
                       torch::Tensor seen, torch::Tensor rows, bool cumulative) {
  const std::vector<double> masses = chunk_masses(probs, bounds);
  const int64_t n = static_cast<int64_t>(masses.size());
  TORCH_CHECK_VALUE(values.dim() == 2 && values.scalar_type() == torch::kFloat64 && values.is_contiguous() &&
                        seen.dim() == 1 && seen.scalar_type() == torch::kInt64 && seen.is_contiguous() &&
                        seen.size(0) == values.size(0) && rows.dim() == 1 &&
                        rows.scalar_type() == torch::kInt64 && rows.is_contiguous() && rows.size(0) == n &&
                        values.size(1) >= 1,
                    "observe_masses: values float64 [R, depth], seen int64 [R], rows int64 [chunks] wanted");
  double* v = values.data_ptr<double>();
  int64_t* s = seen.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t depth = values.size(1);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(r[i] >= 0 && r[i] < values.size(0), "observe_masses: a row outside the tracker's");
    if (!std::isfinite(masses[i]) || masses[i] < 0.0) return i;
  }
  for (int64_t i = 0; i < n; ++i) {
    double* row = v + r[i] * depth;
    if (cumulative)
      row[0] += masses[i];
    else
      row[s[r[i]] % depth] = masses[i];
    ++s[r[i]];
  }
  return -1;
}

// The largest of p[0, n) (n > 0); NaN when any value is NaN.
static float row_max(const float* p, int64_t n) {
  float top = p[0];
  bool nan = false;
  int64_t i = 0;
#if KVOS_AVX2
  __m256 tops[4], odd = _mm256_setzero_ps();  // four running maxima, and any NaN seen (unordered lanes)
  for (auto& t : tops) t = _mm256_set1_ps(top);
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(p + i + 8 * j);
      tops[j] = _mm256_max_ps(tops[j], v);
      odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  float lanes_top[8];
  const __m256 both = _mm256_max_ps(_mm256_max_ps(tops[0], tops[1]), _mm256_max_ps(tops[2], tops[3]));
  _mm256_storeu_ps(lanes_top, both);
  for (float t : lanes_top) top = std::max(top, t);
  nan = _mm256_movemask_ps(odd) != 0;
#endif
  for (; i < n; ++i) {
    top = p[i] > top ? p[i] : top;
    nan |= p[i] != p[i];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : top;
}

// log sum_i e^(p_i) given the largest value ``top`` (finite): e^(p - top) in float32, eight terms a lane
// summed in float32 then in double.
static double log_sum_exp(const float* p, int64_t n, float top) {
  double sum = 0.0;
  int64_t i = 0;
#if KVOS_AVX2
  // four independent float32 sums of 8 lanes, each lane adding at most 8 terms of at most 1 before the
  // four go into double (a float32 error of a few ulp of 8: far below the double sum's other terms)
  const __m256 shift = _mm256_set1_ps(top);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 256 <= n; i += 256) {
#if KVOS_AVX512  // 16 lanes a vector: each of the 8 final lanes adds 8 terms, as below
    const __m512 wide = _mm512_set1_ps(top);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; j < 256; j += 64)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm512_add_ps(acc[u], exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i + j + 16 * u), wide)));
    const __m512 both = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    const __m256 block = _mm256_add_ps(
        _mm512_castps512_ps256(both), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1)));
#else
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < 256; j += 32)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_add_ps(acc[u], exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i + j + 8 * u), shift)));
    const __m256 block = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
#endif
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(block)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(block, 1)));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  double lanes[8];
  _mm256_storeu_pd(lanes, lo);
  _mm256_storeu_pd(lanes + 4, hi);
  for (double l : lanes) sum += l;
#endif
  for (; i < n; ++i) sum += static_cast<double>(std::exp(p[i] - top));
  return static_cast<double>(top) + std::log(sum);
}

// The first index of ``top`` in p[0, n).
static int64_t first_at(const float* p, int64_t n, float top) {
  int64_t i = 0;
#if KVOS_AVX2
  const __m256 want = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), want, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
#endif
  for (; i < n; ++i)
    if (p[i] == top) return i;
  return n;
}

// log sum_i e^(x_i) over a float32 vector: the log-softmax normaliser of one row of logits (a token's
// log-probability, kvos/engine/sampling.py). NaN where a value is NaN or the largest is infinite: the
// caller's numpy path handles those.
double log_normaliser(torch::Tensor x) {
  TORCH_CHECK_VALUE(x.dim() == 1 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() &&
                        x.is_contiguous() && x.numel() > 0,
                    "log_normaliser: a contiguous float32 vector on the CPU wanted");
  const float* p = x.data_ptr<float>();
  const float top = row_max(p, x.numel());
  if (!std::isfinite(top)) return std::numeric_limits<double>::quiet_NaN();
  return log_sum_exp(p, x.numel(), top);
}

// Per row of logits, what a token's pick and its log-probability read (kvos/engine/logit_stats.py): the
// largest logit, the first index holding it and the log-softmax normaliser, as float64 [rows, 3]; a row
// with a NaN or an infinite largest value gets NaN in all three. Rows run in parallel.
torch::Tensor row_stats(std::vector<torch::Tensor> rows) {
  for (const auto& r : rows)
    TORCH_CHECK_VALUE(r.scalar_type() == torch::kFloat32 && r.device().is_cpu() && r.is_contiguous() &&
                          r.numel() > 0,
                      "row_stats: contiguous float32 rows on the CPU wanted");
  const int64_t count = static_cast<int64_t>(rows.size());
  auto out = torch::empty({count, 3}, torch::kFloat64);
  double* o = out.data_ptr<double>();
  at::parallel_for(0, count, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = rows[r].data_ptr<float>();
      const int64_t n = rows[r].numel();
      const float top = row_max(p, n);
      double* row = o + 3 * r;
      if (!std::isfinite(top)) {
        row[0] = row[1] = row[2] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      row[0] = top;
      row[1] = static_cast<double>(first_at(p, n, top));
      row[2] = log_sum_exp(p, n, top);
    }
  });
  return out;
}

torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                     torch::Tensor lengths, torch::Tensor kpos, torch::Tensor qpos, int64_t window,
                     torch::Tensor probs, torch::Tensor hk, torch::Tensor hv, torch::Tensor codes,
                     int64_t parts) {
  const bool half = k.dtype() == torch::kFloat16;
  TORCH_CHECK(q.dtype() == torch::kFloat32 && (half || k.dtype() == torch::kFloat32) &&
                  v.dtype() == k.dtype(), "float32 queries, a float32 or float16 pool");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.is_contiguous() && v.is_contiguous() &&
                  slots.is_contiguous() &&
                  kpos.is_contiguous() && lengths.is_contiguous() && qpos.is_contiguous(),
              "contiguous inputs");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && slots.dim() == 2,
              "q [B, H, D], k [S, Hkv, D], slots [B, T]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), T = slots.size(1);
  TORCH_CHECK(k.size(2) == D && v.sizes() == k.sizes() && H % Hkv == 0, "shapes disagree");
  TORCH_CHECK(slots.size(0) == B && kpos.sizes() == slots.sizes() && lengths.size(0) == B &&
                  qpos.size(0) == B, "per-sequence inputs disagree with q");
  const bool capture = probs.numel() > 0;
  TORCH_CHECK(!capture || (probs.is_contiguous() && probs.dtype() == torch::kFloat32 &&
                           probs.size(0) == B && probs.size(1) == H && probs.size(2) == T),
              "probs must be float32 [B, H, T]");
  const int64_t S = k.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const bool per_head = codes.numel() > 0;
  TORCH_CHECK(!per_head || (codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == B &&
                            codes.size(1) == Hkv && codes.size(2) == T && hk.dim() == 2 &&
                            hk.size(1) == D && hk.is_contiguous() && hv.sizes() == hk.sizes() &&
                            hv.is_contiguous() && hk.dtype() == k.dtype() && hv.dtype() == k.dtype()),
              "head codes [B, Hkv, T] with a head store [R, D] of the pool's dtype");
  const int64_t R = per_head ? hk.size(0) : 0;
  const int64_t* cd = per_head ? codes.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] <= T, "a length is out of range");
    for (int64_t t = 0; t < len[b]; ++t)
      TORCH_CHECK(sl[b * T + t] >= 0 && sl[b * T + t] < S, "a slot is out of range");
    for (int64_t i = 0; per_head && i < Hkv; ++i)
      for (int64_t t = 0; t < len[b]; ++t) {
        const int64_t c = cd[(b * Hkv + i) * T + t];
        TORCH_CHECK(c >= -2 && c < R, "a head code is out of range");
      }
  }
  auto out = torch::empty({B, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0);  // a row of the fused projection's output: q is read where it lies
  const int64_t* kpp = kpos.data_ptr<int64_t>();
  const int64_t* qpp = qpos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* pp = capture ? probs.data_ptr<float>() : nullptr;
  if (half)
    attend_all<c10::Half>(qp, q_row, k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>(), sl, len, kpp, qpp,
                          window, B, H, Hkv, D, T, op, pp,
                          per_head ? hk.data_ptr<c10::Half>() : nullptr,
                          per_head ? hv.data_ptr<c10::Half>() : nullptr, cd, parts);
  else
    attend_all<float>(qp, q_row, k.data_ptr<float>(), v.data_ptr<float>(), sl, len, kpp, qpp, window, B, H,
                      Hkv, D, T, op, pp, per_head ? hk.data_ptr<float>() : nullptr,
                      per_head ? hv.data_ptr<float>() : nullptr, cd, parts);
  return out;
}

// The address of attend, for the step kernel (kvos/model/step_kernel.py).
std::vector<int64_t> entries() { return {reinterpret_cast<int64_t>(&attend)}; }
"""
)


FUNCTIONS = ["entries", "attend", "chunk_masses", "log_normaliser", "observe_masses", "row_stats"]


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    return build("kvos_decode_v17", _SOURCE, FUNCTIONS, ["-O3", "-march=native"], "the gathered attention")


@functools.cache
def portable_kernel() -> Any | None:
    """The same functions built without SIMD intrinsics (a CPU without AVX2/FMA/F16C), for tests."""
    flags = ["-O3", "-DKVOS_PORTABLE"]
    return build("kvos_decode_portable_v17", _SOURCE, FUNCTIONS, flags, "the gathered attention")


@functools.cache
def avx2_kernel() -> Any | None:
    """The functions this CPU builds without AVX-512 (the path of an AVX2 CPU such as AMD Zen 3), for tests
    on a CPU with AVX-512."""
    flags = ["-O3", "-march=native", "-mno-avx512f"]
    return build("kvos_decode_avx2_v17", _SOURCE, FUNCTIONS, flags, "the gathered attention")


BUILDS = {"native": kernel, "avx2": avx2_kernel, "portable": portable_kernel}  # the builds tests force


def module() -> Any:
    """The compiled module, where :func:`usable` said yes."""
    built = kernel()
    assert built is not None, "the decode kernel is not built: check usable() first"
    return built


def usable(q: torch.Tensor, k_slab: torch.Tensor) -> bool:
    """Whether the kernel computes this decode attention: float32 queries, a float32 or float16 pool, both
    on the CPU, the kernel built."""
    return (
        q.dtype == torch.float32
        and k_slab.dtype in KERNEL_KV_DTYPES
        and q.device.type == k_slab.device.type == "cpu"
        and kernel() is not None
    )


def decode_attention(
    q: torch.Tensor,
    k_slab: torch.Tensor,
    v_slab: torch.Tensor,
    group: DecodeGroup,
    window: int | None,
    layer: int,
    heads: tuple[torch.Tensor, torch.Tensor] = (EMPTY, EMPTY),
) -> torch.Tensor:
    """The decode steps of ``group`` over the pool layer ``k_slab``/``v_slab`` [S, Hkv, D]: q [B, H, D]
    float32 -> [B, H * D]. ``heads``: the pool's head store [R, D] (K, V) where some sequences keep tokens
    per KV head (``group.head_codes``). Each sequence's probabilities [H, n] are captured where its metadata
    asks, as the gathered path captures them."""
    built = module()
    slots, lengths, key_positions, positions = group.kernel_inputs()
    b, num_heads, _ = q.shape
    wanted = [layer in m.capture_layers for m in group.metas]
    probs = torch.zeros(b, num_heads, slots.shape[1]) if any(wanted) else EMPTY
    out = built.attend(
        q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous(),
        k_slab,
        v_slab,
        slots,
        lengths,
        key_positions,
        positions,
        window or 0,
        probs,
        *heads,
        group.head_codes(layer),
        0,
    )
    for row, (meta, n) in enumerate(zip(group.metas, group.lengths, strict=True)):
        if wanted[row]:
            meta.captured[layer] = probs[row, :, :n]
    return out
