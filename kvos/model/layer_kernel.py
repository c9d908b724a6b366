"""CPU kernels for the steps between a layer's products: what eager PyTorch runs as many small ops.

A decode step of a small model does a few microseconds of arithmetic a layer between its matrix products,
and eager PyTorch spends a hundred times that dispatching the ~40 ATen ops that do it (RMSNorm alone is six;
RoPE, the bias, the per-head norms and the two pool writes another fifteen). Three calls replace them:

- ``rms_norm(x, w, eps)``: x float32 [n, d], w [d] -> x * rsqrt(mean(x^2) + eps) * w, [n, d];
- ``qkv_step(qkv, bias, q_norm, k_norm, eps, cos, sin, k_slab, v_slab, slots, H, Hkv)``: on the fused
  projection's output qkv float32 [n, (H + 2 Hkv) D], in place: the bias added (``bias`` [(H + 2 Hkv) D] or
  empty), each query and key head RMS-normed (``q_norm``/``k_norm`` [D] or empty; Qwen3), queries and keys
  rotated (``cos``/``sin`` [n, 1, D] from :meth:`kvos.model.rope.Rope.cos_sin`: the sign of rotate-half is
  in ``sin``), then each row's keys and values written to its pool slot (``k_slab``/``v_slab`` [S, Hkv, D],
  float32 or float16, rounded to nearest; ``slots`` int64 [n]; empty slabs: no write);
- ``silu_mul(gu)``: gu float32 [n, 2 I] (gate, then up) -> silu(gate) * up, [n, I].

The rotation is computed as the eager path computes it (``x * cos + roll(x) * sin``, each product rounded,
no fused multiply-add: ``-ffp-contract=off``), so rotated rows are bit-identical to
:meth:`~kvos.model.rope.Rope.apply`. The norms sum their squares in another order than torch (1-2 ulp), and
SiLU takes :mod:`kvos.model.simd_exp`'s exponential. Rows are split over threads when there are many
(prefill). Compiled on first use; without it :class:`~kvos.model.transformer.Transformer` runs the eager ops.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvos.extensions import build
from kvos.model.dtype import KERNEL_KV_DTYPES
from kvos.model.simd_exp import SOURCE as EXP8

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVOS_PORTABLE)
#include <immintrin.h>
#define KVOS_AVX2 1
#endif
"""
    + EXP8
    + r"""
constexpr int64_t GRAIN = 16;  // rows per thread task: a decode step's few rows stay on one thread

// sum of x[i]^2 over n floats, in 16 running sums (vectorised by the compiler).
static inline float sum_squares(const float* x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[i + l] * x[i + l];
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i] over d floats (out may be x).
static inline void norm_row(const float* x, const float* w, int64_t d, float eps, float* out) {
  const float r = 1.0f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = (x[i] * r) * w[i];
}

// One head of D floats rotated in place: x * cos + roll(x, D / 2) * sin (sin carries rotate-half's sign).
static inline void rotate(float* x, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t h = D / 2;
  std::memcpy(tmp, x, D * sizeof(float));
  for (int64_t d = 0; d < h; ++d) x[d] = tmp[d] * cos[d] + tmp[d + h] * sin[d];
  for (int64_t d = h; d < D; ++d) x[d] = tmp[d] * cos[d] + tmp[d - h] * sin[d];
}

static void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous float32 CPU tensor");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_float(x, "x");
  check_float(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "x [n, d] and w [d]");
  const int64_t n = x.size(0), d = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * d, wp, d, static_cast<float>(eps), op + r * d);
  });
  return out;
}

void qkv_step(torch::Tensor qkv, torch::Tensor bias, torch::Tensor q_norm, torch::Tensor k_norm, double eps,
              torch::Tensor cos, torch::Tensor sin, torch::Tensor k_slab, torch::Tensor v_slab,
              torch::Tensor slots, int64_t H, int64_t Hkv) {
  check_float(qkv, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(qkv.dim() == 2 && H > 0 && Hkv > 0 && H % Hkv == 0,
              "qkv [n, (H + 2 Hkv) D], H a multiple of Hkv");
  const int64_t n = qkv.size(0), width = qkv.size(1), heads = H + 2 * Hkv;
  TORCH_CHECK(width % heads == 0 && (width / heads) % 2 == 0, "qkv's width is not (H + 2 Hkv) x an even D");
  const int64_t D = width / heads;
  TORCH_CHECK(cos.numel() == n * D && sin.numel() == n * D, "cos and sin must be [n, 1, D]");
  const bool has_bias = bias.numel() > 0, has_norm = q_norm.numel() > 0;
  if (has_bias) {
    check_float(bias, "bias");
    TORCH_CHECK(bias.numel() == width, "bias must be [(H + 2 Hkv) D]");
  }
  TORCH_CHECK(q_norm.numel() == k_norm.numel(), "q_norm and k_norm come together");
  if (has_norm) {
    check_float(q_norm, "q_norm");
    check_float(k_norm, "k_norm");
    TORCH_CHECK(q_norm.numel() == D && k_norm.numel() == D, "q_norm and k_norm must be [D]");
  }
  const bool write = k_slab.numel() > 0;
  const bool half = write && k_slab.dtype() == torch::kFloat16;
  int64_t S = 0;
  if (write) {
    TORCH_CHECK((half || k_slab.dtype() == torch::kFloat32) && v_slab.dtype() == k_slab.dtype() &&
                    k_slab.is_contiguous() && v_slab.is_contiguous() && k_slab.device().is_cpu() &&
                    v_slab.device().is_cpu(),
                "k_slab and v_slab must be contiguous float32 or float16 CPU tensors");
    TORCH_CHECK(k_slab.dim() == 3 && k_slab.size(1) == Hkv && k_slab.size(2) == D &&
                    v_slab.sizes() == k_slab.sizes(), "k_slab and v_slab must be [S, Hkv, D]");
    TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.dim() == 1 &&
                    slots.size(0) == n, "slots must be int64 [n]");
    S = k_slab.size(0);
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(sl[r] >= 0 && sl[r] < S, "slot ", sl[r], " is out of range for a pool of ", S, " slots");
  }
  float* x = qkv.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const float* qn = has_norm ? q_norm.data_ptr<float>() : nullptr;
  const float* kn = has_norm ? k_norm.data_ptr<float>() : nullptr;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = write && !half ? k_slab.data_ptr<float>() : nullptr;
  float* vp = write && !half ? v_slab.data_ptr<float>() : nullptr;
  c10::Half* kh = half ? k_slab.data_ptr<c10::Half>() : nullptr;
  c10::Half* vh = half ? v_slab.data_ptr<c10::Half>() : nullptr;
  const int64_t* sl = write ? slots.data_ptr<int64_t>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, GRAIN, [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(D);
    for (int64_t r = r0; r < r1; ++r) {
      float* row = x + r * width;
      if (bp)
        for (int64_t i = 0; i < width; ++i) row[i] += bp[i];
      for (int64_t h = 0; h < H + Hkv; ++h) {
        float* head = row + h * D;
        if (qn) norm_row(head, h < H ? qn : kn, D, e, head);
        rotate(head, cp + r * D, sp + r * D, D, tmp.data());
      }
      if (half) {  // rounded to the nearest float16, as Tensor.to(torch.float16) rounds
        for (int64_t i = 0; i < Hkv * D; ++i) {
          kh[sl[r] * Hkv * D + i] = c10::Half(row[H * D + i]);
          vh[sl[r] * Hkv * D + i] = c10::Half(row[(H + Hkv) * D + i]);
        }
      } else if (write) {
        std::memcpy(kp + sl[r] * Hkv * D, row + H * D, Hkv * D * sizeof(float));
        std::memcpy(vp + sl[r] * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(float));
      }
    }
  });
}

// silu(g) * u = g / (1 + e^-g) * u over n floats.
static inline void silu_mul_row(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#if KVOS_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

torch::Tensor silu_mul(torch::Tensor gu) {
  check_float(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be [n, 2 I]");
  const int64_t n = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({n, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * 2 * I, gp + r * 2 * I + I, I, op + r * I);
  });
  return out;
}

// The addresses of rms_norm, qkv_step and silu_mul, for the step kernel (kvos/model/step_kernel.py).
std::vector<int64_t> entries() {
  return {reinterpret_cast<int64_t>(&rms_norm), reinterpret_cast<int64_t>(&qkv_step),
          reinterpret_cast<int64_t>(&silu_mul)};
}
"""
)


FUNCTIONS = ["entries", "rms_norm", "qkv_step", "silu_mul"]


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    flags = ["-O3", "-march=native", "-ffp-contract=off"]
    return build("kvos_layer_v4", _SOURCE, FUNCTIONS, flags, "eager torch ops between the products")


@functools.cache
def portable_kernel() -> Any | None:
    """The same functions built without SIMD intrinsics (a CPU without AVX2/FMA), for tests."""
    flags = ["-O3", "-DKVOS_PORTABLE", "-ffp-contract=off"]
    return build("kvos_layer_portable_v4", _SOURCE, FUNCTIONS, flags, "eager torch ops between the products")


BUILDS = {"native": kernel, "portable": portable_kernel}  # every build the tests force, by name


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take these activations: float32 on the CPU, the kernel built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernel() is not None


def writes_into(k_slab: torch.Tensor) -> bool:
    """Whether ``qkv_step`` writes K/V straight into this pool layer: contiguous, on the CPU, in a dtype the
    kernels take (:data:`~kvos.model.dtype.KERNEL_KV_DTYPES`)."""
    return k_slab.dtype in KERNEL_KV_DTYPES and k_slab.device.type == "cpu" and k_slab.is_contiguous()


def module() -> Any:
    """The compiled module, where :func:`usable` said yes."""
    built = kernel()
    assert built is not None, "the layer kernel is not built: check usable() first"
    return built


EMPTY = torch.empty(0)
