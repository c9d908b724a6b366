"""The C++ float vector the CPU kernels write their loops in: ``Vec`` and ``LANES`` (16 floats in a 512-bit
register where the including kernel defines ``KVOS_AVX512``, else 8 in a 256-bit one where it defines
``KVOS_AVX2``; after ``<immintrin.h>``) and its operations, so that a loop written once serves both builds.
:mod:`kvos.model.dense_kernel` (the products) and :mod:`kvos.model.prefill_kernel` (a prefill's attention)
put it into their sources; with neither macro defined (a portable build) it defines nothing.
"""

SOURCE = r"""
#if KVOS_AVX512
using Vec = __m512;
constexpr int64_t LANES = 16;
static inline Vec vzero() { return _mm512_setzero_ps(); }
static inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
static inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
static inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif KVOS_AVX2
using Vec = __m256;
constexpr int64_t LANES = 8;
static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
static inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif
"""
