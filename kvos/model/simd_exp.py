"""The C++ exponential the CPU kernels share: ``exp8`` (e^x for 8 floats in AVX2/FMA registers), defined where
the including kernel defines ``KVOS_AVX2`` (and has included ``<immintrin.h>``), and ``exp16`` (16 floats in
AVX-512 registers) where it also defines ``KVOS_AVX512``.

x = n ln2 + r with r in [-ln2 / 2, ln2 / 2] (ln2 split in two parts for an exact reduction), e^r by Cephes'
degree-6 polynomial, 2^n built in the exponent bits; inputs clamped to [-87.3, 88.3] so that 2^n stays a
normal float (a NaN stays NaN). Relative error within 2 ulp of ``std::exp`` over that range.
:mod:`kvos.model.decode_kernel` (the softmax) and :mod:`kvos.model.layer_kernel` (SiLU) put it into their
sources.
"""

from string import Template

# one exponential, written out for each register width: $P the intrinsics' prefix, $V the float vector type,
# $I the integer one, $FLOOR rounding n down, $CAST the bits of e as floats
_EXP = Template(
    r"""$GUARD
$COMMENT
static inline $V $NAME($V x) {
$CLAMP_NOTE  x = ${P}_min_ps(${P}_set1_ps(88.3f), ${P}_max_ps(${P}_set1_ps(-87.3f), x));
  const $V log2e = ${P}_set1_ps(1.44269504088896341f);
  $V n = $FLOOR;
  x = ${P}_fnmadd_ps(n, ${P}_set1_ps(0.693359375f), x);
  x = ${P}_fnmadd_ps(n, ${P}_set1_ps(-2.12194440e-4f), x);
  $V y = ${P}_set1_ps(1.9875691500e-4f);
  y = ${P}_fmadd_ps(y, x, ${P}_set1_ps(1.3981999507e-3f));
  y = ${P}_fmadd_ps(y, x, ${P}_set1_ps(8.3334519073e-3f));
  y = ${P}_fmadd_ps(y, x, ${P}_set1_ps(4.1665795894e-2f));
  y = ${P}_fmadd_ps(y, x, ${P}_set1_ps(1.6666665459e-1f));
  y = ${P}_fmadd_ps(y, x, ${P}_set1_ps(5.0000001201e-1f));
  y = ${P}_fmadd_ps(y, ${P}_mul_ps(x, x), ${P}_add_ps(x, ${P}_set1_ps(1.0f)));
  $I e = ${P}_slli_epi32(${P}_add_epi32(${P}_cvtps_epi32(n), ${P}_set1_epi32(127)), 23);
  return ${P}_mul_ps(y, $CAST(e));
}
#endif
"""
)


def _exp(bits: int, name: str, guard: str, comment: str, floor: str, note: str = "") -> str:
    """The exponential for ``bits``-bit registers, named ``name``, compiled under ``#if guard``."""
    p = f"_mm{bits}"
    return _EXP.substitute(
        GUARD=f"#if {guard}",
        COMMENT=comment,
        NAME=name,
        V=f"__m{bits}",
        I=f"__m{bits}i",
        P=p,
        CLAMP_NOTE=note,
        FLOOR=floor,
        CAST=f"{p}_castsi{bits}_ps",
    )


SOURCE = (
    "\n"
    + _exp(
        256,
        "exp8",
        "KVOS_AVX2",
        "// e^x for 8 floats: x = n ln2 + r, e^r by a degree-6 polynomial, 2^n into the exponent bits.",
        "_mm256_floor_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5f)))",
        "  // x second: max and min return their second operand where either is NaN, so a NaN stays NaN\n",
    )
    + _exp(
        512,
        "exp16",
        "KVOS_AVX512",
        "// exp8 for 16 floats in a 512-bit register: the same reduction, polynomial and clamp "
        "(NaN stays NaN).",
        "_mm512_roundscale_ps(_mm512_fmadd_ps(x, log2e, _mm512_set1_ps(0.5f)),\n"
        "                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)",
    )
)
