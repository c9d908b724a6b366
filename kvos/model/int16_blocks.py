"""The C++ of the output head's product: activations as int16 blocks against 8-bit weights.

The next token is chosen from the head's logits, and int8 activations there (llama.cpp's choice) change
answers: they turn SmolLM2 Q4_1's greedy answer to "What is the capital of France?" from Paris into
llama.cpp's wrong one. Float32 activations keep the answers but widen every weight to float, and the head
is the largest matrix of a step (a third of Qwen2.5-Coder-0.5B's decode). Here each 32 values of a row are
quantized to int16 (``d = max|x| / 32767``, ``q = round(x * (1 / d))``, ties to even; a NaN or an infinity
makes the block's scale NaN and its values 0, as the int8 blocks do), which carries each value to within
``max|x| / 65534`` of its block, 256 times closer than int8, and the products are integer: ``vpdpwssd``
with AVX512-VNNI, ``vpmaddwd`` with AVX-512 or AVX2, a portable loop otherwise. Each group's integer sum is
scaled once by both scales.

``SOURCE`` (included in :mod:`kvos.model.quant_kernel` after :mod:`kvos.model.int8_blocks`, whose
``block_max``, ``block_scale``, ``each_tile`` and ``KVOS_VNNI`` it uses) defines ``Int16Rows`` and
``tile_i16``.
"""

SOURCE = r"""
#if KVOS_INT8_SIMD && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVOS_I16_512 1
#endif

// Rows x float32 [n, K] as int16 blocks: q [n, K], d [n, K / 32] (see kvos/model/int16_blocks.py).
struct Int16Rows {
  std::vector<int16_t> q;
  std::vector<float> d;
  Int16Rows(const float* x, int64_t n, int64_t K) : q(n * K), d(n * K / 32) {
    for (int64_t b = 0; b < n * K / 32; ++b) {
      const float* xb = x + b * 32;
      bool finite;
      const float amax = block_max(xb, finite);
      float inv;
      d[b] = block_scale(amax, finite, inv, 32767.0f);
      for (int j = 0; j < 32; ++j) {
        const float v = finite ? std::nearbyint(xb[j] * inv) : 0.0f;
        q[b * 32 + j] = static_cast<int16_t>(std::min(32767.0f, std::max(-32767.0f, v)));
      }
    }
  }
};

// One group's products for T rows of x: acc[i] += (w . x_i) * sr[g] * xd_i[g] (512-bit or AVX2); Acc16 the
// running sums' type, total16 two of them added and summed across lanes.
#if KVOS_I16_512
using Acc16 = __m512;
static inline float total16(Acc16 a, Acc16 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

template <int T>
static inline void group_i16(const int16_t* xq, const float* xd, int64_t groups, int64_t g, const int8_t* wr,
                             const float* sr, __m512* acc) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + g * 32)));
  for (int i = 0; i < T; ++i) {
    const __m512i x = _mm512_loadu_si512(xq + (i * groups + g) * GROUP);
#if KVOS_VNNI
    const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, x);
#else
    const __m512i p = _mm512_madd_epi16(w, x);
#endif
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(sr[g] * xd[i * groups + g]), acc[i]);
  }
}
#elif KVOS_INT8_SIMD
using Acc16 = __m256;
static inline float total16(Acc16 a, Acc16 b) { return hsum8(_mm256_add_ps(a, b)); }

template <int T>
static inline void group_i16(const int16_t* xq, const float* xd, int64_t groups, int64_t g, const int8_t* wr,
                             const float* sr, __m256* acc) {
  const int8_t* wg = wr + g * 32;
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16)));
  for (int i = 0; i < T; ++i) {
    const int16_t* x = xq + (i * groups + g) * GROUP;
    const __m256i p =
        _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                         _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sr[g] * xd[i * groups + g]), acc[i]);
  }
}
#endif

// total[i] = x_i . w_r for T rows of x as int16 blocks (xq [T, K], xd [T, groups]) and an 8-bit weight row
// w_r (scales sr): per group the integer dot product times both scales, in two running sums a row (even and
// odd groups).
template <int T>
static inline void tile_i16(const int16_t* xq, const float* xd, int64_t K, const int8_t* wr, const float* sr,
                            float* total) {
  const int64_t groups = K / GROUP;
#if KVOS_INT8_SIMD  // (KVOS_I16_512 implies it)
  Acc16 even[T], odd[T];
  for (int i = 0; i < T; ++i) even[i] = odd[i] = Acc16{};
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    group_i16<T>(xq, xd, groups, g, wr, sr, even);
    group_i16<T>(xq, xd, groups, g + 1, wr, sr, odd);
  }
  if (g < groups) group_i16<T>(xq, xd, groups, g, wr, sr, even);
  for (int i = 0; i < T; ++i) total[i] = total16(even[i], odd[i]);
#else
  for (int i = 0; i < T; ++i) {
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const int16_t* x = xq + (i * groups + g) * GROUP;
      int32_t dot = 0;
      for (int64_t j = 0; j < GROUP; ++j) dot += int32_t(wr[g * GROUP + j]) * x[j];
      acc += static_cast<float>(dot) * (sr[g] * xd[i * groups + g]);
    }
    total[i] = acc;
  }
#endif
}
"""
