"""A fused re-anchoring write for restores on CPU: one pass that reads each saved K and V row once, rotates
the keys to their new positions in registers and writes both straight into their pool slots.

Eager PyTorch needs a temporary and four passes over the keys for the same work (``Rope.rotate`` then
``KVPool.write``); a restore is bandwidth-bound, so this kernel is what brings a restore near the cost of a
plain copy of its bytes. It is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler is
needed; the build is cached) and used for float32 and float16 CPU pools (the saved rows in the pool's dtype);
anything else, a failed build, or ``KVOS_NO_EXTENSIONS=1`` falls back to the eager path, which gives the same
keys within float32 rounding (float16: within one float16 step, where that rounding crosses its grid).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from kvos.extensions import build
from kvos.model.dtype import KERNEL_KV_DTYPES
from kvos.model.rope import Rope

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#if defined(__AVX__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX 1
#endif

// One head's key row x [D] rotated into o [D] with the pair tables c, s [half]:
//   o[d] = x[d] c[d] - x[d + half] s[d],  o[d + half] = x[d + half] c[d] + x[d] s[d],
// each product rounded, then the sum (no FMA), the operations Rope.rotate_into performs. With stream, o is
// 32-byte aligned and half % 8 == 0: AVX loads, non-temporal stores.
static inline void rotate_head(float* o, const float* x, const float* c, const float* s, int64_t half,
                               bool stream) {
#if KVOS_AVX
  if (stream) {
    for (int64_t d = 0; d < half; d += 8) {
      const __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + d + half);
      const __m256 cd = _mm256_loadu_ps(c + d), sd = _mm256_loadu_ps(s + d);
      _mm256_stream_ps(o + d, _mm256_sub_ps(_mm256_mul_ps(x1, cd), _mm256_mul_ps(x2, sd)));
      _mm256_stream_ps(o + d + half, _mm256_add_ps(_mm256_mul_ps(x1, sd), _mm256_mul_ps(x2, cd)));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = x[d], x2 = x[d + half];
    const float lo = x2 * s[d], hi = x1 * s[d];
    o[d] = x1 * c[d] - lo;
    o[d + half] = hi + x2 * c[d];
  }
}

// The same rotation for a float16 row: widened to float32, the same products and sum, rounded to nearest
// even once (as Tensor.to(torch.float16) rounds). With stream, o is 16-byte aligned and half % 8 == 0.
static inline void rotate_head(c10::Half* o, const c10::Half* x, const float* c, const float* s, int64_t half,
                               bool stream) {
#if KVOS_AVX && defined(__F16C__)
  if (half % 8 == 0) {
    constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t d = 0; d < half; d += 8) {
      const __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d)));
      const __m256 x2 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d + half)));
      const __m256 cd = _mm256_loadu_ps(c + d), sd = _mm256_loadu_ps(s + d);
      const __m128i lo = _mm256_cvtps_ph(_mm256_sub_ps(_mm256_mul_ps(x1, cd), _mm256_mul_ps(x2, sd)), round);
      const __m128i hi = _mm256_cvtps_ph(_mm256_add_ps(_mm256_mul_ps(x1, sd), _mm256_mul_ps(x2, cd)), round);
      __m128i* out_lo = reinterpret_cast<__m128i*>(o + d);
      __m128i* out_hi = reinterpret_cast<__m128i*>(o + d + half);
      if (stream) {
        _mm_stream_si128(out_lo, lo);
        _mm_stream_si128(out_hi, hi);
      } else {
        _mm_storeu_si128(out_lo, lo);
        _mm_storeu_si128(out_hi, hi);
      }
    }
    return;
  }
#endif
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
    const float lo = x2 * s[d], hi = x1 * s[d];
    o[d] = c10::Half(x1 * c[d] - lo);
    o[d + half] = c10::Half(hi + x2 * c[d]);
  }
}

// count values from src to dst; with stream, dst is 32-byte aligned and count values are a multiple of 32
// bytes.
template <typename E>
static inline void copy_row(E* dst, const E* src, int64_t count, bool stream) {
#if KVOS_AVX
  if (stream) {
    const int64_t bytes = count * static_cast<int64_t>(sizeof(E));
    char* d = reinterpret_cast<char*>(dst);
    const char* from = reinterpret_cast<const char*>(src);
    for (int64_t j = 0; j < bytes; j += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + j),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + j)));
    return;
  }
#endif
  std::memcpy(dst, src, sizeof(E) * count);
}

// cos64, sin64: [P, half] float64 angle tables (Rope.angle_tables); old, new: int64 [n] positions
// -> float32 [n, half] cos and sin of new - old, computed as Rope.half_rotation computes them from the same
// tables (products and sums each rounded in float64, then one rounding to float32): bit-identical. Returns
// nothing when a position lies outside [0, P) (the caller grows the tables).
std::vector<torch::Tensor> pair_tables(torch::Tensor cos64, torch::Tensor sin64, torch::Tensor old_pos,
                                       torch::Tensor new_pos) {
  TORCH_CHECK_VALUE(cos64.scalar_type() == torch::kFloat64 && cos64.is_contiguous() && cos64.dim() == 2 &&
                        sin64.sizes() == cos64.sizes() && sin64.scalar_type() == torch::kFloat64 &&
                        sin64.is_contiguous(),
                    "pair_tables: tables must be contiguous float64 [P, half]");
  TORCH_CHECK_VALUE(old_pos.scalar_type() == torch::kInt64 && new_pos.scalar_type() == torch::kInt64 &&
                        old_pos.is_contiguous() && new_pos.is_contiguous() && old_pos.dim() == 1 &&
                        old_pos.sizes() == new_pos.sizes(),
                    "pair_tables: positions must be contiguous int64 [n], old and new alike");
  const int64_t n = old_pos.size(0), P = cos64.size(0), half = cos64.size(1);
  const int64_t* a = old_pos.data_ptr<int64_t>();
  const int64_t* b = new_pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (a[i] < 0 || a[i] >= P || b[i] < 0 || b[i] >= P) return {};
  }
  torch::Tensor cos = torch::empty({n, half}, torch::TensorOptions().dtype(torch::kFloat32));
  torch::Tensor sin = torch::empty({n, half}, torch::TensorOptions().dtype(torch::kFloat32));
  const double* C = cos64.data_ptr<double>();
  const double* S = sin64.data_ptr<double>();
  float* co = cos.data_ptr<float>();
  float* so = sin.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const double *ca = C + a[i] * half, *sa = S + a[i] * half, *cb = C + b[i] * half, *sb = S + b[i] * half;
    for (int64_t d = 0; d < half; ++d) {
      const double cc = cb[d] * ca[d], ss = sb[d] * sa[d], sc = sb[d] * ca[d], cs = cb[d] * sa[d];
      co[i * half + d] = static_cast<float>(cc + ss);
      so[i * half + d] = static_cast<float>(sc - cs);
    }
  }
  return {cos, sin};
}

static bool dense_f32(const torch::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
}

// float32 or float16 (the pool's dtype, which K and V share), contiguous, on the CPU.
static bool dense_kv(const torch::Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous();
}

// Everything rotate_write relies on, checked before it writes raw memory (ValueError in Python).
static void check_inputs(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slots,
                         const std::vector<torch::Tensor>& pool_k, const std::vector<torch::Tensor>& pool_v,
                         const torch::Tensor& cos, const torch::Tensor& sin, bool rotate) {
  const at::ScalarType dtype = k.scalar_type();
  TORCH_CHECK_VALUE((dtype == torch::kFloat32 || dtype == torch::kFloat16) && k.dim() == 4 &&
                        k.sizes() == v.sizes() && dense_kv(k, dtype) && dense_kv(v, dtype),
                    "rotate_write: K and V must be contiguous float32 or float16 CPU tensors [L, n, H, D] "
                    "of one shape and dtype");
  const int64_t L = k.size(0), n = k.size(1);
  TORCH_CHECK_VALUE(static_cast<int64_t>(pool_k.size()) == L && static_cast<int64_t>(pool_v.size()) == L,
                    "rotate_write: the pool has ", pool_k.size(), " layers, K/V have ", L);
  for (int64_t l = 0; l < L; ++l) {
    for (const torch::Tensor* t : {&pool_k[l], &pool_v[l]}) {
      TORCH_CHECK_VALUE(dense_kv(*t, dtype) && t->dim() == 4 && t->sizes() == pool_k[0].sizes() &&
                            t->size(2) == k.size(2) && t->size(3) == k.size(3),
                        "rotate_write: pool layers must be contiguous [blocks, bs, H, D] of K/V's dtype");
    }
  }
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == n && slots.scalar_type() == torch::kInt64 &&
                        slots.is_contiguous() && slots.device().is_cpu(),
                    "rotate_write: slots must be a contiguous int64 CPU tensor [", n, "]");
  const int64_t rows = L ? pool_k[0].size(0) * pool_k[0].size(1) : 0;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(sp[i] >= 0 && sp[i] < rows, "rotate_write: slots must lie in [0, ", rows, ")");
  }
  if (rotate) {
    TORCH_CHECK_VALUE(dense_f32(cos) && dense_f32(sin) && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                          cos.size(0) == n && cos.size(1) == k.size(3) / 2 && k.size(3) % 2 == 0,
                      "rotate_write: rotation tables must be contiguous float32 [n, head_dim / 2]");
  }
}

// k, v: [L, n, H, D] float32; slots: int64 [n]; pool_k / pool_v: L tensors [blocks, bs, H, D] float32;
// cos, sin: [n, D / 2] float32 (Rope.half_rotation), used when rotate is true. Rows go in layer-major order
// (measured faster than tiles of tokens across all layers), with software prefetch AHEAD rows ahead.
// stream asks for non-temporal stores (a large restore: no read-for-ownership of pool lines it overwrites
// whole); it is honoured where the build has AVX and every pool row is 32-byte aligned.
template <typename E>
static void rotate_write_as(torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                            std::vector<torch::Tensor> pool_k, std::vector<torch::Tensor> pool_v,
                            torch::Tensor cos, torch::Tensor sin, bool rotate, bool stream) {
  const int64_t L = k.size(0), n = k.size(1), H = k.size(2), D = k.size(3), half = D / 2, row = H * D;
  const E* kp = k.data_ptr<E>();
  const E* vp = v.data_ptr<E>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* cp = rotate ? cos.data_ptr<float>() : nullptr;
  const float* snp = rotate ? sin.data_ptr<float>() : nullptr;
  std::vector<E*> dk(L), dv(L);
  bool aligned = D % 16 == 0;
  for (int64_t l = 0; l < L; ++l) {
    dk[l] = pool_k[l].data_ptr<E>();
    dv[l] = pool_v[l].data_ptr<E>();
    aligned = aligned && reinterpret_cast<std::uintptr_t>(dk[l]) % 32 == 0;
    aligned = aligned && reinterpret_cast<std::uintptr_t>(dv[l]) % 32 == 0;
  }
#if KVOS_AVX
  stream = stream && aligned;
#else
  stream = false;
#endif
  constexpr int64_t AHEAD = 8;  // rows prefetched ahead
  at::parallel_for(0, L * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t l = idx / n, i = idx % n;
      const E* src = kp + idx * row;
      E* out = dk[l] + sp[i] * row;
      if (idx + AHEAD < end) {  // the hardware prefetcher alone leaves this loop waiting on memory
        for (int64_t j = 0; j < row; j += 16) {
          __builtin_prefetch(src + AHEAD * row + j);
          __builtin_prefetch(vp + (idx + AHEAD) * row + j);
        }
      }
      if (rotate) {
        for (int64_t h = 0; h < H; ++h) {
          rotate_head(out + h * D, src + h * D, cp + i * half, snp + i * half, half, stream);
        }
      } else {
        copy_row(out, src, row, stream);
      }
      copy_row(dv[l] + sp[i] * row, vp + idx * row, row, stream);
    }
#if KVOS_AVX
    if (stream) _mm_sfence();  // this thread's non-temporal stores land before the pool is read
#endif
  });
}

// k, v and the pool share one dtype: float32, or float16 (rows widened, rotated in float32, rounded once).
void rotate_write(torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                  std::vector<torch::Tensor> pool_k, std::vector<torch::Tensor> pool_v,
                  torch::Tensor cos, torch::Tensor sin, bool rotate, bool stream) {
  check_inputs(k, v, slots, pool_k, pool_v, cos, sin, rotate);
  if (k.scalar_type() == torch::kFloat16)
    rotate_write_as<c10::Half>(k, v, slots, pool_k, pool_v, cos, sin, rotate, stream);
  else
    rotate_write_as<float>(k, v, slots, pool_k, pool_v, cos, sin, rotate, stream);
}
"""


_EMPTY = torch.empty(0)
STREAM_MIN_BYTES = 4 << 20  # restores this large write the pool with non-temporal stores


FUNCTIONS = ["rotate_write", "pair_tables"]


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    flags = ["-O3", "-march=native", "-ffp-contract=off"]
    return build("kvos_fused_restore_v6", _SOURCE, FUNCTIONS, flags, "the eager path")


@functools.cache
def portable_kernel() -> Any | None:
    """The same functions built without SIMD intrinsics (a CPU without AVX/F16C), for tests."""
    flags = ["-O3", "-DKVOS_PORTABLE", "-ffp-contract=off"]
    return build("kvos_fused_restore_portable_v6", _SOURCE, FUNCTIONS, flags, "the eager path")


BUILDS = {"native": kernel, "portable": portable_kernel}  # every build the tests force, by name


def half_rotation(rope: Rope, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Rope.half_rotation` on CPU (float32 [n, head_dim / 2] cos and sin), bit-identical, computed by
    the kernel from the rope's cached angle tables in one pass where they cover the positions (the tables
    grow when they do not). Falls back to the rope when the kernel is unavailable."""
    cpu = torch.device("cpu")
    module = kernel()
    if module is not None:
        old, new = (
            t if t.dtype == torch.int64 and t.is_contiguous() else t.long().contiguous() for t in (old, new)
        )
        for tables in (rope.cached_tables(cpu), rope.angle_tables(old, new, cpu)):
            pair = module.pair_tables(*tables, old, new) if tables is not None else None
            if pair:
                return pair[0], pair[1]
    return rope.half_rotation(old, new, cpu)


def usable(pool_k: Sequence[torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`rotate_write` applies: a float32 or float16 CPU pool and rows of its dtype, contiguous,
    and the kernel built (the pool's layer tensors share one dtype and device: the first stands for all;
    rotate_write checks their shapes and contiguity)."""
    tensors = [k, v, pool_k[0]]
    dtype = pool_k[0].dtype
    return (
        dtype in KERNEL_KV_DTYPES
        and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)
        and kernel() is not None
    )


def rotate_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    pool_k: Sequence[torch.Tensor],
    pool_v: Sequence[torch.Tensor],
    rotation: tuple[torch.Tensor, torch.Tensor] | None,
    stream: bool | None = None,
) -> None:
    """Write saved K/V ([L, n, H, D], float32 or float16 as the pool) into the pool's flat ``slots`` (int64
    [n]) of every layer, keys rotated by ``rotation`` ((cos, sin) float32 [n, D / 2] from
    ``Rope.half_rotation``; float16 keys are rotated in float32 and rounded once) or copied as is.

    ``stream``: non-temporal stores (default: when K and V together reach :data:`STREAM_MIN_BYTES`, as
    large ``memcpy`` calls do; a small restore is better left in cache for the attention that reads it
    next). Either way the pool holds the same bits. The kernel checks dtypes, shapes, contiguity and slot
    ranges before it writes raw memory: :class:`ValueError` otherwise."""
    module = kernel()
    assert module is not None, "check usable() first"
    if stream is None:
        stream = k.nbytes + v.nbytes >= STREAM_MIN_BYTES
    cos, sin = rotation if rotation is not None else (_EMPTY, _EMPTY)
    module.rotate_write(k, v, slots, list(pool_k), list(pool_v), cos, sin, rotation is not None, stream)
