"""The C++ both quantized-weight kernels share for int8 activations (:mod:`kvos.model.activations`).

``SOURCE`` defines ``quantize_blocks`` (activation rows to llama.cpp's Q8_0 blocks: for each 32 values
``d = max|x| / 127`` and ``q = round(x * (1 / d))``, ties to even, with ``d * sum(q)`` for each half of 16,
what a weight's min multiplies), ``Int8Rows`` (a tensor's rows so quantized), ``each_tile`` (the products'
loop over weight rows and tiles of up to four activation rows), ``Int8Chunks`` (those rows
re-laid for 4-bit weights read four groups at a time, with AVX-512 VNNI) and, where the including
kernel defines ``KVOS_INT8_SIMD`` (AVX2; then ``<immintrin.h>`` is included), ``dot4``: the dot products of
32 unsigned with 32 signed bytes, four at a time (``maddubs`` + ``madd``, or one ``vpdpbusd`` with
AVX512-VNNI). :mod:`kvos.model.quant_kernel` and :mod:`kvos.model.gguf_kernel` put it into their sources,
so both quantize activations the same way.
"""

SOURCE = r"""
#include <limits>
#include <type_traits>
#if KVOS_INT8_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVOS_VNNI 1  // one instruction for the four-byte dot products
#endif
#if KVOS_VNNI && defined(__AVX512BW__)
#define KVOS_VNNI512 1  // 64-byte tiles: four 4-bit groups (two 8-bit ones) an instruction
#endif

// The largest magnitude of the 32 values at xb, and whether all of them are finite (portable loop).
static inline float block_max(const float* xb, bool& finite) {
  float amax = 0.0f;
  finite = true;
  for (int j = 0; j < 32; ++j) {
    amax = std::max(amax, std::fabs(xb[j]));
    finite = finite && std::isfinite(xb[j]);
  }
  return amax;
}

// One block's scale from its largest magnitude (top: the largest quantized value, 127 for int8), and the
// factor its values are multiplied by: a NaN or an infinity in the block (finite false) makes the scale NaN
// and the factor 0.
static inline float block_scale(float amax, bool finite, float& inv, float top = 127.0f) {
  const float scale = finite ? amax / top : std::nanf("");
  inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  if (!std::isfinite(inv)) inv = 0.0f;  // a subnormal scale: q = 0
  return scale;
}

#if KVOS_INT8_SIMD && defined(__AVX512F__) && defined(__AVX512BW__)
// One block with two 16-float vectors: the scalar loop's values bit for bit (the same product x * inv,
// rounded to nearest even by the conversion, as nearbyint rounds in the default mode).
static inline void quantize_block(const float* xb, int8_t* q, float* d, float* hsum) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const bool finite = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) ==
                      0xFFFF;  // a NaN compares false too
  float inv;
  const float scale = block_scale(finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : 0.0f, finite, inv);
  const __m512 f = _mm512_set1_ps(inv);
  const __mmask16 keep = finite ? 0xFFFF : 0;  // (inf * 0 is NaN, whose conversion is not 0)
  const __m512i v0 = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(x0, f));
  const __m512i v1 = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(x1, f));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(v0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(v1));
  *d = scale;
  hsum[0] = scale * static_cast<float>(_mm512_reduce_add_epi32(v0));
  hsum[1] = scale * static_cast<float>(_mm512_reduce_add_epi32(v1));
}
#elif KVOS_INT8_SIMD
// As above with four 8-float vectors (AVX2).
static inline void quantize_block(const float* xb, int8_t* q, float* d, float* hsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 x[4], top = _mm256_setzero_ps();
  int finite_lanes = 0xFF;
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_loadu_ps(xb + 8 * j);
    const __m256 a = _mm256_andnot_ps(sign, x[j]);
    finite_lanes &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));
    top = _mm256_max_ps(top, a);
  }
  const bool finite = finite_lanes == 0xFF;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  float inv;
  const float scale = block_scale(finite ? _mm_cvtss_f32(m) : 0.0f, finite, inv);
  const __m256 f = _mm256_set1_ps(inv);
  const __m256i keep = _mm256_set1_epi32(finite ? -1 : 0);  // (inf * 0 is NaN, whose conversion is not 0)
  __m256i v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm256_and_si256(keep, _mm256_cvtps_epi32(_mm256_mul_ps(x[j], f)));
  // packs interleave the 128-bit lanes: [0-3 8-11 | 4-7 12-15] then bytes [0 2 1 3] in 32-bit lanes
  const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = scale;
  for (int h = 0; h < 2; ++h) {
    __m256i s = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    hsum[h] = scale * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}
#endif

// x [blocks * 32] to q int8 [blocks * 32], d [blocks] and hsum [blocks * 2] (see kvos/model/int8_blocks.py).
// A NaN or an infinity makes its block's scale NaN (its products NaN, as in float32) and its q zero.
static void quantize_blocks(const float* x, int64_t blocks, int8_t* q, float* d, float* hsum) {
#if KVOS_INT8_SIMD
  for (int64_t b = 0; b < blocks; ++b) quantize_block(x + b * 32, q + b * 32, d + b, hsum + 2 * b);
#else
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * 32;
    bool finite;
    const float amax = block_max(xb, finite);
    float inv;
    const float scale = block_scale(amax, finite, inv);
    int32_t sum[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int v = finite ? static_cast<int>(std::nearbyint(xb[j] * inv)) : 0;
      q[b * 32 + j] = static_cast<int8_t>(v);
      sum[j / 16] += v;
    }
    d[b] = scale;
    hsum[2 * b] = scale * static_cast<float>(sum[0]);
    hsum[2 * b + 1] = scale * static_cast<float>(sum[1]);
  }
#endif
}

// Rows x float32 [n, K] as int8 blocks: q [n, K], d [n, K / 32], h [n, K / 32, 2] (quantize_blocks).
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, h;
  Int8Rows(const float* x, int64_t n, int64_t K) : q(n * K), d(n * K / 32), h(n * K / 16) {
    quantize_blocks(x, n * K / 32, q.data(), d.data(), h.data());
  }
};

// The products' loop: for weight rows r0..r1 and the n rows of x four at a time, tile(r, i0, rows, total)
// with rows a std::integral_constant<int, t> (t = 1..4 rows of x from i0) fills total[0..t) with their dot
// products with weight row r; out[i0 + i, r] (N columns) is set to it, or has it added (add). The weight's
// row r + ahead is asked for as row r begins (prefetch: kvos/model/row_prefetch.py).
template <typename Tile>
static inline void each_tile(int64_t n, int64_t r0, int64_t r1, float* out, int64_t N, bool add,
                             const RowPrefetch& prefetch, Tile&& tile) {
  float total[4];
  for (int64_t r = r0; r < r1; ++r) {
    prefetch(r);
    for (int64_t i0 = 0; i0 < n; i0 += 4) {
      const int64_t t = std::min<int64_t>(4, n - i0);
      switch (t) {
        case 1: tile(r, i0, std::integral_constant<int, 1>{}, total); break;
        case 2: tile(r, i0, std::integral_constant<int, 2>{}, total); break;
        case 3: tile(r, i0, std::integral_constant<int, 3>{}, total); break;
        default: tile(r, i0, std::integral_constant<int, 4>{}, total); break;
      }
      for (int64_t i = 0; i < t; ++i) {
        float* dst = out + (i0 + i) * N + r;
        *dst = add ? *dst + total[i] : total[i];
      }
    }
  }
}

#if KVOS_VNNI512
// Quantized activation rows laid out for 4-bit weights read 64 bytes (four groups) at a time, the weights'
// low nibbles being elements 0-15 of their group and the high ones 16-31: per chunk of four groups, the
// first halves (16 values) of the four, then their second halves; with each group's scale d and sum
// h0 + h1 (what a min multiplies). Zeros pad the last chunk. q [n, chunks, 128], d and s [n, chunks * 4].
struct Int8Chunks {
  int64_t chunks;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  Int8Chunks(const Int8Rows& x, int64_t n, int64_t groups)
      : chunks((groups + 3) / 4), q(n * chunks * 128, 0), d(n * chunks * 4, 0.0f), s(n * chunks * 4, 0.0f) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = i * groups + g, c = i * chunks * 4 + g;
        int8_t* dst = q.data() + (i * chunks + g / 4) * 128 + (g % 4) * 16;
        std::copy_n(x.q.data() + b * 32, 16, dst);
        std::copy_n(x.q.data() + b * 32 + 16, 16, dst + 64);
        d[c] = x.d[b];
        s[c] = x.h[2 * b] + x.h[2 * b + 1];
      }
  }
};
#endif

#if KVOS_INT8_SIMD
// Dot products of 32 unsigned bytes u with 32 signed bytes s, four at a time: int32 [8] (lanes 0-3 are
// bytes 0-15, lanes 4-7 bytes 16-31).
static inline __m256i dot4(__m256i u, __m256i s) {
#if KVOS_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // no saturation: |u| <= 128, |s| <= 127
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif
"""
