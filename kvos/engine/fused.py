"""A fused re-anchoring write for restores on CPU: one pass that reads each saved K and V row once, rotates
the keys to their new positions in registers and writes both straight into their pool slots.

Eager PyTorch needs a temporary and four passes over the keys for the same work (``Rope.rotate`` then
``KVPool.write``); a restore is bandwidth-bound, so this kernel is what brings a restore near the cost of a
plain copy of its bytes. It is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler is
needed; the build is cached) and used only for float32 CPU pools; anything else, a failed build, or
``KVOS_NO_EXTENSIONS=1`` falls back to the eager path, which gives the same keys within float32 rounding.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>

// k, v: [L, n, H, D] float32; slots: int64 [n]; pool_k / pool_v: L tensors [blocks, bs, H, D] float32;
// cos, sin: [n, D] float32 (sin signed as in Rope.rotation), used when rotate is true.
void rotate_write(torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                  std::vector<torch::Tensor> pool_k, std::vector<torch::Tensor> pool_v,
                  torch::Tensor cos, torch::Tensor sin, bool rotate) {
  const int64_t L = k.size(0), n = k.size(1), H = k.size(2), D = k.size(3), half = D / 2, row = H * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* cp = rotate ? cos.data_ptr<float>() : nullptr;
  const float* snp = rotate ? sin.data_ptr<float>() : nullptr;
  std::vector<float*> dk(L), dv(L);
  for (int64_t l = 0; l < L; ++l) {
    dk[l] = pool_k[l].data_ptr<float>();
    dv[l] = pool_v[l].data_ptr<float>();
  }
  at::parallel_for(0, L * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t l = idx / n, i = idx % n;
      const float* src = kp + idx * row;
      float* out = dk[l] + sp[i] * row;
      if (rotate) {
        const float* c = cp + i * D;
        const float* s = snp + i * D;
        for (int64_t h = 0; h < H; ++h) {
          const float* x = src + h * D;
          float* o = out + h * D;
          for (int64_t d = 0; d < half; ++d) {
            const float t = x[d + half] * s[d];
            o[d] = t + x[d] * c[d];
          }
          for (int64_t d = half; d < D; ++d) {
            const float t = x[d - half] * s[d];
            o[d] = t + x[d] * c[d];
          }
        }
      } else {
        std::memcpy(out, src, sizeof(float) * row);
      }
      std::memcpy(dv[l] + sp[i] * row, vp + idx * row, sizeof(float) * row);
    }
  });
}
"""


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    if os.environ.get("KVOS_NO_EXTENSIONS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="kvos_fused_restore_v2",
            cpp_sources=[_SOURCE],
            functions=["rotate_write"],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, headers missing: the eager path still works
        warnings.warn(f"kvos: fused restore kernel unavailable, using the eager path ({exc})", stacklevel=2)
        return None


def usable(pool_k: Sequence[torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`rotate_write` applies: float32 CPU pool and rows, contiguous, and the kernel built."""
    tensors = [k, v, *pool_k]
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    ) and (kernel() is not None)


def rotate_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    pool_k: Sequence[torch.Tensor],
    pool_v: Sequence[torch.Tensor],
    rotation: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Write saved K/V ([L, n, H, D] float32) into the pool's flat ``slots`` (int64 [n]) of every layer,
    keys rotated by ``rotation`` ((cos, signed sin) [n, 1, D] from ``Rope.rotation``) or copied as is.
    Shapes and slot ranges are checked here: the kernel writes raw memory."""
    module = kernel()
    assert module is not None, "check usable() first"
    slots = slots.to(dtype=torch.int64).contiguous()
    rows = pool_k[0].shape[0] * pool_k[0].shape[1]
    shapes_ok = k.shape == v.shape and k.shape[0] == len(pool_k) == len(pool_v) == len(pool_v)
    shapes_ok = shapes_ok and k.shape[1] == slots.shape[0] and k.shape[2:] == pool_k[0].shape[2:]
    if not shapes_ok or any(t.shape != pool_k[0].shape for t in (*pool_k, *pool_v)):
        raise ValueError(
            f"rotate_write: K/V {tuple(k.shape)} do not match the pool or {slots.shape[0]} slots"
        )
    if slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < rows):
        raise ValueError(f"rotate_write: slots must lie in [0, {rows})")
    if rotation is None:
        empty = torch.empty(0)
        module.rotate_write(k, v, slots, list(pool_k), list(pool_v), empty, empty, False)
        return
    cos, sin = (t.reshape(t.shape[0], -1).contiguous() for t in rotation)
    module.rotate_write(k, v, slots, list(pool_k), list(pool_v), cos, sin, True)
