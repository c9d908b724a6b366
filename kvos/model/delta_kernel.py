"""A CPU kernel for the decode steps of gated delta-nets (hybrid models' linear-attention layers).

``steps(states, q, k, v, decay, beta)`` takes one token of each of ``B`` sequences: their states (a list of
float32 [H, Dk, Dv], one a sequence), q and k float32 [B, H, Dk] (normalised, q scaled), v [B, H, Dv], the
decay ``exp(g)`` and beta [B, H]. It returns the outputs [B, H, Dv] and a new state for each sequence (the
states given are not written). Per (sequence, head) the state is read twice and written once: first
``r = decay * (k . S)``, then ``S' = decay * S + k (beta (v - r))^T`` row by row, the output ``q . S'``
accumulated as each row is written. The torch path (``DeltaNet.run_decodes``) stacks the states and reads
and writes them five times; this is where a batch of decode steps spends its time beside the products.
Compiled on first use (:func:`kvos.extensions.build`); without it the torch path runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvos.extensions import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <vector>

// One (sequence, head): S [Dk, Dv] -> S2 [Dk, Dv], out [Dv].
static void step_one(const float* S, float* S2, const float* q, const float* k, const float* v, float decay,
                     float beta, int64_t Dk, int64_t Dv, float* out) {
  std::vector<float> r(Dv, 0.0f), u(Dv);
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = k[i];
    const float* row = S + i * Dv;
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) r[j] += ki * row[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < Dv; ++j) {
    u[j] = beta * (v[j] - decay * r[j]);
    out[j] = 0.0f;
  }
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = k[i], qi = q[i];
    const float* row = S + i * Dv;
    float* row2 = S2 + i * Dv;
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) {
      const float s = decay * row[j] + ki * u[j];
      row2[j] = s;
      out[j] += qi * s;
    }
  }
}

std::vector<torch::Tensor> steps(std::vector<torch::Tensor> states, torch::Tensor q, torch::Tensor k,
                                 torch::Tensor v, torch::Tensor decay, torch::Tensor beta) {
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2);
  TORCH_CHECK(static_cast<int64_t>(states.size()) == B, "one state a sequence");
  for (const auto& t : {q, k, v, decay, beta})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), "contiguous float32 inputs");
  std::vector<torch::Tensor> out_states;
  std::vector<const float*> src(B);
  std::vector<float*> dst(B);
  for (int64_t b = 0; b < B; ++b) {
    const auto& s = states[b];
    TORCH_CHECK(s.dtype() == torch::kFloat32 && s.is_contiguous() && s.numel() == H * Dk * Dv,
                "each state contiguous float32 [H, Dk, Dv]");
    out_states.push_back(torch::empty_like(s));
    src[b] = s.data_ptr<float>();
    dst[b] = out_states.back().data_ptr<float>();
  }
  auto out = torch::empty({B, H, Dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H;
      step_one(src[b] + h * Dk * Dv, dst[b] + h * Dk * Dv, qp + t * Dk, kp + t * Dk, vp + t * Dv, dp[t],
               bp[t], Dk, Dv, op + t * Dv);
    }
  });
  out_states.push_back(out);
  return out_states;
}
"""


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    return build("kvos_delta_v1", _SOURCE, ["steps"], ["-O3", "-march=native"], "torch ops")


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel takes these rows: float32 on the CPU, the kernel built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernel() is not None


def steps(
    states: list[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The module docstring's step for ``B`` sequences -> (outputs [B, H, Dv], the new states)."""
    built = kernel()
    assert built is not None, "the delta kernel is not built: check usable() first"
    result = built.steps(
        [s.contiguous() for s in states],
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        decay.contiguous(),
        beta.contiguous(),
    )
    return result[-1], result[:-1]
