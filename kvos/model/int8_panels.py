"""The C++ of the many-row product with int8 activations: weight rows decoded eight at a time into a panel.

A prefill multiplies each weight row with hundreds of activation rows. The few-row kernels decode a weight
group for every four activation rows and scale every group's integer dot product on its own; here a panel
of eight weight rows is decoded once per call, its small integers laid side by side (for each run of four
values of a group, the eight rows' four bytes in one 32-byte vector), so that one ``maddubs`` (or
``vpdpbusd``) against four activation bytes broadcast to every lane gives all eight rows' partial sums at
once. The sums stay integer over a group (a half-group for the types with 16-value scales) and are scaled
once per group and activation row, for eight weight rows at a time. On an AMD Zen 5 core this runs at
75-130 G multiply-adds a second where the float32 matmul of the dequantized weights reaches ~47
(Qwen2.5-Coder-0.5B's shapes, 128 rows; docs/benchmarks.md).

The weights' integers enter ``maddubs`` as its unsigned operand. Types whose integers are small and signed
(Q4_0, Q5_0, Q3_K, Q6_K) are shifted by an offset into 0..63, the offset entering as a min
(``w = s * (q + off) + (m - off * s)``); Q8_0 and the IQ4 types keep their signs and take the sign trick
(``|w|`` against ``x`` with ``w``'s sign). Mins multiply the half-groups' activation sums
(:mod:`kvos.model.int8_blocks`' ``h``), as in the few-row kernels. The sums are exact: 16-bit partial sums are
widened before they can overflow (after 8 runs of 4 values for integers < 16, 4 for < 32, 2 for < 64, 1 for
signed).

``SOURCE`` defines ``has_panels``, ``Path`` and ``takes_panels`` (which path a product of n rows takes:
from the rows set for the weight's kind, ``set_panel_rows`` and ``panel_rows_of``, which
:mod:`kvos.model.panel_rows` measures) and, where the including kernel defines ``KVOS_INT8_SIMD`` (after
:mod:`kvos.model.int8_blocks`), ``Panel`` (eight decoded rows: ``set`` fills one row's group, ``finish`` lays
them out) and ``panels_product`` (panels filled by the caller against every activation row);
:mod:`kvos.model.quant_kernel` and :mod:`kvos.model.gguf_kernel` fill panels from their own layouts.
"""

SOURCE = r"""
#include <atomic>

// Whether this build has the panel product (integer SIMD); without it mm_i8_panels runs the tiles.
bool has_panels() {
#if KVOS_INT8_SIMD
  return true;
#else
  return false;
#endif
}

// How mm_i8 multiplies: AUTO chooses; TILES: each weight row against four activation rows at a time (a
// decode step); PANELS: eight weight rows decoded once against every activation row (a prefill).
enum Path { AUTO, TILES, PANELS };
constexpr int64_t PANEL_MIN_ROWS = 16;  // AUTO's default: from 16 rows the panels matched the tiles (Zen 5)
constexpr int64_t PANEL_KINDS = 16;     // the weight kinds a kernel numbers (quant_kernel: 0 8-bit, 1 4-bit;
                                        // gguf_kernel: its Type)

// The fewest activation rows from which AUTO takes the panels, per weight kind; 0: PANEL_MIN_ROWS. Set from
// what this machine measured (kvos/model/panel_rows.py): on an AMD Zen 4 the 4-bit tiles stay faster up to
// 24-48 rows, Q5_0's panels win from 8.
static std::atomic<int64_t> panel_rows_by_kind[PANEL_KINDS];

static inline int64_t panel_rows(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind < PANEL_KINDS, "weight kind ", kind, " is outside 0-", PANEL_KINDS - 1);
  const int64_t rows = panel_rows_by_kind[kind].load(std::memory_order_relaxed);
  return rows > 0 ? rows : PANEL_MIN_ROWS;
}

// From `rows` activation rows on, AUTO multiplies weights of `kind` by the panels (0: back to the default);
// returns the previous setting (0 where it was the default).
int64_t set_panel_rows(int64_t kind, int64_t rows) {
  TORCH_CHECK(kind >= 0 && kind < PANEL_KINDS, "weight kind ", kind, " is outside 0-", PANEL_KINDS - 1);
  TORCH_CHECK(rows >= 0, "panel rows must be 0 (the default) or more, got ", rows);
  return panel_rows_by_kind[kind].exchange(rows);
}

// The rows from which AUTO takes the panels for `kind` now.
int64_t panel_rows_of(int64_t kind) { return panel_rows(kind); }

static inline bool takes_panels(Path path, int64_t n, int64_t kind) {
  return has_panels() && (path == PANELS || (path == AUTO && n >= panel_rows(kind)));
}

#if KVOS_INT8_SIMD
constexpr int PANEL = 8;  // weight rows a panel

// Eight weight rows of K values decoded for panels_product: q [groups][8 runs][8 rows][4] (each run's four
// values of the eight rows side by side), s and m [groups][2 halves][8 rows] (scale and min of each half).
// Filled a row at a time (set: the row's groups as decoded, w = s_h * v + m_h in half h), then laid out
// (finish). Rows not set are zero.
struct Panel {
  int64_t groups;
  std::vector<int8_t> rows;  // [8][groups * 32]: the rows as set
  std::vector<uint8_t> q;
  std::vector<float> s, m;
  explicit Panel(int64_t groups)
      : groups(groups), rows(PANEL * groups * 32), q(groups * 256), s(groups * 16), m(groups * 16) {}

  void set(int r, int64_t g, const int8_t* v, const float* sh, const float* mh) {
    std::memcpy(rows.data() + (r * groups + g) * 32, v, 32);
    for (int h = 0; h < 2; ++h) {
      s[g * 16 + h * 8 + r] = sh[h];
      m[g * 16 + h * 8 + r] = mh[h];
    }
  }

  // Rows r0.. zero; every value shifted by `offset` (into 0..63 for the unsigned types), the offset
  // moved into the mins; each group's eight rows transposed into runs (an 8 x 8 transpose of 4-byte units).
  void finish(int r0, int offset) {
    for (int r = r0; r < PANEL; ++r) {
      std::memset(rows.data() + r * groups * 32, 0, groups * 32);
      for (int64_t g = 0; g < groups; ++g)
        for (int h = 0; h < 2; ++h) s[g * 16 + h * 8 + r] = m[g * 16 + h * 8 + r] = 0.0f;
    }
    for (size_t k = 0; k < s.size(); ++k) m[k] -= static_cast<float>(offset) * s[k];
    const __m256i off = _mm256_set1_epi8(static_cast<char>(offset));
    for (int64_t g = 0; g < groups; ++g) {
      __m256i v[PANEL], t[PANEL], u[PANEL];
      for (int r = 0; r < PANEL; ++r)
        v[r] = _mm256_add_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.data() + (r * groups + g) * 32)), off);
      for (int r = 0; r < PANEL; r += 2) {
        t[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);
        t[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]);
      }
      for (int r = 0; r < PANEL; r += 4) {
        u[r] = _mm256_unpacklo_epi64(t[r], t[r + 2]);
        u[r + 1] = _mm256_unpackhi_epi64(t[r], t[r + 2]);
        u[r + 2] = _mm256_unpacklo_epi64(t[r + 1], t[r + 3]);
        u[r + 3] = _mm256_unpackhi_epi64(t[r + 1], t[r + 3]);
      }
      __m256i* dst = reinterpret_cast<__m256i*>(q.data() + g * 256);
      for (int c = 0; c < 4; ++c) {
        _mm256_storeu_si256(dst + c, _mm256_permute2x128_si256(u[c], u[c + 4], 0x20));
        _mm256_storeu_si256(dst + c + 4, _mm256_permute2x128_si256(u[c], u[c + 4], 0x31));
      }
    }
  }
};

// out[i0 + b, r0 + 0..rows) (= or +=) the panel's rows . activation row i0 + b, for b < RX.
// SIGNED: the panel holds signed integers (sign trick); ADDS: runs whose 16-bit sums may be added before
// widening (<= 4 with HALVES); HALVES: each half-group has its own scale (else one a group); MIN: the panel
// has mins (or offsets).
template <bool SIGNED, int ADDS, bool HALVES, bool MIN, int RX>
static inline void panel_rows(const Panel& p, const Int8Rows& xi, int64_t i0, int64_t K, float* out,
                              int64_t N, int64_t r0, int rows, bool add) {
  static_assert(!HALVES || 4 % ADDS == 0, "a half's sums are widened before it is scaled");
  const int64_t groups = K / 32;
  const int8_t* xq = xi.q.data() + i0 * K;
  const float* xd = xi.d.data() + i0 * groups;
  const float* xh = xi.h.data() + i0 * groups * 2;
  __m256 acc[RX], accm[RX];
  for (int b = 0; b < RX; ++b) acc[b] = accm[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = p.q.data() + g * 256;
    const float* sg = p.s.data() + g * 16;
    const float* mg = p.m.data() + g * 16;
    __m256i s32[RX];
    for (int b = 0; b < RX; ++b) s32[b] = _mm256_setzero_si256();
#if !KVOS_VNNI
    __m256i s16[RX];
    for (int b = 0; b < RX; ++b) s16[b] = _mm256_setzero_si256();
#endif
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 32));
      const __m256i u = SIGNED ? _mm256_sign_epi8(w, w) : w;
      for (int b = 0; b < RX; ++b) {
        int32_t x4;
        std::memcpy(&x4, xq + b * K + g * 32 + c * 4, 4);
        const __m256i x = SIGNED ? _mm256_sign_epi8(_mm256_set1_epi32(x4), w) : _mm256_set1_epi32(x4);
#if KVOS_VNNI
        s32[b] = _mm256_dpbusd_epi32(s32[b], u, x);
#else
        s16[b] = _mm256_add_epi16(s16[b], _mm256_maddubs_epi16(u, x));
        if ((c + 1) % ADDS == 0) {
          s32[b] = _mm256_add_epi32(s32[b], _mm256_madd_epi16(s16[b], _mm256_set1_epi16(1)));
          s16[b] = _mm256_setzero_si256();
        }
#endif
      }
      if (HALVES && c % 4 == 3) {  // half c / 4 done: scale it
        const int h = c / 4;
        const __m256 sh = _mm256_loadu_ps(sg + h * 8);
        for (int b = 0; b < RX; ++b) {
          const __m256 d = _mm256_mul_ps(sh, _mm256_set1_ps(xd[b * groups + g]));
          acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[b]), d, acc[b]);
          s32[b] = _mm256_setzero_si256();
          if (MIN) {  // the min times the half's activation sum
            const __m256 xs = _mm256_set1_ps(xh[(b * groups + g) * 2 + h]);
            accm[b] = _mm256_fmadd_ps(_mm256_loadu_ps(mg + h * 8), xs, accm[b]);
          }
        }
      }
    }
    if (!HALVES) {
      const __m256 sh = _mm256_loadu_ps(sg);
      for (int b = 0; b < RX; ++b) {
        const float* hb = xh + (b * groups + g) * 2;
        const __m256 d = _mm256_mul_ps(sh, _mm256_set1_ps(xd[b * groups + g]));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[b]), d, acc[b]);
        if (MIN) accm[b] = _mm256_fmadd_ps(_mm256_loadu_ps(mg), _mm256_set1_ps(hb[0] + hb[1]), accm[b]);
      }
    }
  }
  for (int b = 0; b < RX; ++b) {
    alignas(32) float total[PANEL];
    _mm256_store_ps(total, MIN ? _mm256_add_ps(acc[b], accm[b]) : acc[b]);
    float* dst = out + (i0 + b) * N + r0;
    for (int r = 0; r < rows; ++r) dst[r] = add ? dst[r] + total[r] : total[r];
  }
}

// Panels p0..p1 of the N weight rows against every row of xi: fill(panel, r0, rows) decodes weight rows
// r0..r0 + rows into the panel (set, then finish), then every activation row passes over it, four at a time.
// (Two panels a pass, so that four activation rows of a long row are read once for both: slower on an AMD
// Zen 5, whose 1 MB L2 holds a prefill's activations anyway.)
template <bool SIGNED, int ADDS, bool HALVES, bool MIN, typename Fill>
static void panels_product(const Int8Rows& xi, int64_t n, int64_t K, float* out, int64_t N, int64_t p0,
                           int64_t p1, bool add, Fill&& fill) {
  Panel panel(K / 32);
  for (int64_t pi = p0; pi < p1; ++pi) {
    const int64_t r0 = pi * PANEL;
    const int rows = static_cast<int>(std::min<int64_t>(PANEL, N - r0));
    fill(panel, r0, rows);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
      panel_rows<SIGNED, ADDS, HALVES, MIN, 4>(panel, xi, i, K, out, N, r0, rows, add);
    for (; i < n; ++i) panel_rows<SIGNED, ADDS, HALVES, MIN, 1>(panel, xi, i, K, out, N, r0, rows, add);
  }
}
#endif
"""
