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
#include <type_traits>
#if KVOS_INT8_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVOS_VNNI 1  // one instruction for the four-byte dot products
#endif
#if KVOS_VNNI && defined(__AVX512BW__)
#define KVOS_VNNI512 1  // 64-byte tiles: four 4-bit groups (two 8-bit ones) an instruction
#endif

// x [blocks * 32] to q int8 [blocks * 32], d [blocks] and hsum [blocks * 2] (see kvos/model/int8_blocks.py).
// A NaN or an infinity makes its block's scale NaN (its products NaN, as in float32) and its q zero.
static void quantize_blocks(const float* x, int64_t blocks, int8_t* q, float* d, float* hsum) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      finite = finite && std::isfinite(xb[j]);
    }
    const float scale = finite ? amax / 127.0f : std::nanf("");
    float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    if (!std::isfinite(inv)) inv = 0.0f;  // a subnormal scale: q = 0
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
// products with weight row r; out[i0 + i, r] (N columns) is set to it, or has it added (add).
template <typename Tile>
static inline void each_tile(int64_t n, int64_t r0, int64_t r1, float* out, int64_t N, bool add,
                             Tile&& tile) {
  float total[4];
  for (int64_t r = r0; r < r1; ++r)
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
