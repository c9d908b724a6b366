"""A decode step's layers in one C++ call, without the GIL from the first layer to the last.

:class:`~kvos.model.decode_plan.DecodePlan` runs a layer as nine kernel calls from Python (RMSNorm, the QKV
product, ``qkv_step``, the decode attention, the O product with the residual, RMSNorm, the gate/up product,
SwiGLU, the down product with the residual). Between two calls the interpreter runs a few microseconds of
Python and takes the GIL back: ~0.4 ms a token on SmolLM2's 30 layers, and in the server each of those
returns waits while the event loop holds the lock to write a stream's event. Here the same calls, in the
same order with the same arguments, run in a loop in C++: the kernels are reached by address (each kernel
module's ``entries()``: :mod:`~kvos.model.layer_kernel`, :mod:`~kvos.model.decode_kernel`, and the weights'
product kernels, :class:`~kvos.model.quant.NativePart`), so every result is the Python loop's bit for bit.

A model's layers are bound once (:func:`bind`: weights, norms, products; a handle into this module's table,
freed by :func:`unbind` when the plan goes); a step passes what changes (:func:`run`): the rows, each
layer's rotary tables, pool slabs, head codes and capture buffers, the decode group's inputs.

``bind(norms [5 L], windows [L], parts [P][4], part_tensors [P][*], entries [4], dims [3], eps) -> handle``:
``norms`` per layer (attention norm, QKV bias, query norm, key norm, MLP norm; empty where absent),
``parts`` one row per product part ``(product index 4 l + k, i8 address, f32 address, arg)`` in order (k:
QKV, O, gate/up, down; a product of several parts concatenates their outputs), ``entries`` the addresses of
``rms_norm``, ``qkv_step``, ``silu_mul`` and ``attend``, ``dims`` (H, Hkv, D).

``run(handle, x [n, hidden], cos [L], sin [L], k [L], v [L], full [5], sliding [5], hk, hv, codes [L],
probs [L], int8) -> x [n, hidden]``: ``full``/``sliding`` are (slots, lengths, key positions, positions,
write slots) of the decode group that full-attention and window layers read.

Before a layer's QKV product the loop asks for the first :data:`ASK_KV_ROWS` pool rows (K and V) of each
sequence its attention will read (``prefetcht1``, into L2; at most :data:`ASK_KV_BYTES` a layer): the step's
weights have streamed every layer's keys out of the caches, and the attention, which asks for its rows a
tile at a time from 64 rows ahead, waited on its first ones. Whole decode steps alternated in one process
against the loop without it (AMD Zen 4): SmolLM2 after a 128-token prompt 1.049x at one thread and 1.062x
at two, eight sequences 1.026x (two threads), after 2,048 tokens 1.084x / 0.963x; Qwen2.5 1.060x / 1.000x.
Asking the first 341 rows (256 KB) instead was 2-4% slower than 64. Asking changes no result.
"""

from __future__ import annotations

import functools
from typing import Any

from kvos.extensions import build

ASK_KV_ROWS = 64  # a sequence's first keys asked for ahead: the attention asks for its rows 64 ahead itself
ASK_KV_BYTES = 256 << 10  # of K and V a layer asked for ahead at most: a quarter of a Zen 4 core's L2

_SOURCE = (
    r"""
#include <torch/extension.h>
#include <memory>
#include <mutex>
#include <vector>

// The kernels' types, as their modules define them (layer_kernel.py, decode_kernel.py, the product entries of
// quant_kernel.py and gguf_kernel.py): a kernel whose signature changes changes here too (the tests run both
// loops and compare their results).
using Product = torch::Tensor (*)(const torch::Tensor&, const std::vector<torch::Tensor>&, int64_t,
                                  const torch::Tensor&);
using RmsNorm = torch::Tensor (*)(torch::Tensor, torch::Tensor, double);
using QkvStep = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double, torch::Tensor,
                         torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t);
using SiluMul = torch::Tensor (*)(torch::Tensor);
using Attend = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                 torch::Tensor, torch::Tensor, int64_t, torch::Tensor, torch::Tensor,
                                 torch::Tensor, torch::Tensor, int64_t);

struct Part {
  Product i8, f32;
  std::vector<torch::Tensor> tensors;
  int64_t arg;
};

struct Layer {
  torch::Tensor attn_norm, bias, q_norm, k_norm, mlp_norm;
  std::vector<Part> products[4];  // QKV, O, gate/up, down
  int64_t window;
};

struct Plan {
  std::vector<Layer> layers;
  RmsNorm norm;
  QkvStep step;
  SiluMul silu;
  Attend attend;
  int64_t H, Hkv, D;
  double eps;
};

static std::mutex plans_mu;
static std::vector<std::shared_ptr<const Plan>> plans;  // by handle; a freed handle holds nullptr

static const torch::Tensor& empty_tensor() {
  static const torch::Tensor e = torch::empty({0});
  return e;
}

// Asks for the first ROWS pool rows (K and V) of each sequence that the decode group's attention reads
// (slots [B, T], lengths [B]) into L2, at most BYTES in all: the attention reads them after the QKV product,
// which runs meanwhile. Rows a head store holds instead are asked for all the same (harmless).
static void ask_for_keys(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slots,
                         const torch::Tensor& lengths) {
  constexpr int64_t ROWS = """
    + str(ASK_KV_ROWS)
    + r""", BYTES = """
    + str(ASK_KV_BYTES)
    + r""";
  if (slots.dim() != 2 || slots.numel() == 0 || k.numel() == 0) return;
  const int64_t B = slots.size(0), T = slots.size(1), row = k.stride(0) * k.element_size();
  const char* kb = static_cast<const char*>(k.data_ptr());
  const char* vb = static_cast<const char*>(v.data_ptr());
  const auto slot = slots.accessor<int64_t, 2>();
  const auto length = lengths.accessor<int64_t, 1>();
  int64_t rows = BYTES / std::max<int64_t>(1, 2 * row);
  for (int64_t b = 0; b < B && rows > 0; ++b) {
    const int64_t n = std::min(std::min(std::min(length[b], T), ROWS), rows);
    rows -= n;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t at = slot[b][t] * row;
      for (int64_t o = 0; o < row; o += 64) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("prefetcht1 %0" : : "m"(kb[at + o]));
        __asm__ volatile("prefetcht1 %0" : : "m"(vb[at + o]));
#else
        __builtin_prefetch(kb + at + o, 0, 2), __builtin_prefetch(vb + at + o, 0, 2);
#endif
      }
    }
  }
}

// c + x @ W.T through the product's parts (several: their outputs side by side, then c added).
static torch::Tensor product(const std::vector<Part>& parts, const torch::Tensor& x, const torch::Tensor& c,
                             bool int8) {
  if (parts.size() == 1) {
    const Part& p = parts[0];
    return (int8 ? p.i8 : p.f32)(x, p.tensors, p.arg, c);
  }
  std::vector<torch::Tensor> outs;
  for (const Part& p : parts) outs.push_back((int8 ? p.i8 : p.f32)(x, p.tensors, p.arg, empty_tensor()));
  torch::Tensor out = torch::cat(outs, 1);
  return c.numel() == 0 ? out : out.add_(c);
}

int64_t bind(std::vector<torch::Tensor> norms, std::vector<int64_t> windows,
             std::vector<std::vector<int64_t>> parts, std::vector<std::vector<torch::Tensor>> part_tensors,
             std::vector<int64_t> entries, std::vector<int64_t> dims, double eps) {
  const size_t L = windows.size();
  TORCH_CHECK(norms.size() == 5 * L && parts.size() == part_tensors.size() && entries.size() == 4 &&
                  dims.size() == 3, "bind: inputs disagree");
  auto plan = std::make_shared<Plan>();
  plan->norm = reinterpret_cast<RmsNorm>(entries[0]);
  plan->step = reinterpret_cast<QkvStep>(entries[1]);
  plan->silu = reinterpret_cast<SiluMul>(entries[2]);
  plan->attend = reinterpret_cast<Attend>(entries[3]);
  plan->H = dims[0], plan->Hkv = dims[1], plan->D = dims[2], plan->eps = eps;
  plan->layers.resize(L);
  for (size_t l = 0; l < L; ++l) {
    Layer& layer = plan->layers[l];
    layer.attn_norm = norms[5 * l], layer.bias = norms[5 * l + 1], layer.q_norm = norms[5 * l + 2];
    layer.k_norm = norms[5 * l + 3], layer.mlp_norm = norms[5 * l + 4], layer.window = windows[l];
  }
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& row = parts[p];
    TORCH_CHECK(row.size() == 4 && row[0] >= 0 && static_cast<size_t>(row[0]) < 4 * L,
                "bind: a part is (product index, i8, f32, arg)");
    plan->layers[row[0] / 4].products[row[0] % 4].push_back(
        Part{reinterpret_cast<Product>(row[1]), reinterpret_cast<Product>(row[2]), part_tensors[p], row[3]});
  }
  for (const Layer& layer : plan->layers)
    for (const auto& parts_of : layer.products) TORCH_CHECK(!parts_of.empty(), "bind: a product has no part");
  std::lock_guard<std::mutex> lock(plans_mu);
  plans.push_back(std::move(plan));
  return static_cast<int64_t>(plans.size()) - 1;
}

void unbind(int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mu);
  TORCH_CHECK(handle >= 0 && static_cast<size_t>(handle) < plans.size(), "unbind: no such plan");
  plans[handle] = nullptr;
}

torch::Tensor run(int64_t handle, torch::Tensor x, std::vector<torch::Tensor> cos,
                  std::vector<torch::Tensor> sin, std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
                  std::vector<torch::Tensor> full, std::vector<torch::Tensor> sliding, torch::Tensor hk,
                  torch::Tensor hv, std::vector<torch::Tensor> codes, std::vector<torch::Tensor> probs,
                  bool int8) {
  std::shared_ptr<const Plan> plan;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    TORCH_CHECK(handle >= 0 && static_cast<size_t>(handle) < plans.size() && plans[handle],
                "run: no such plan");
    plan = plans[handle];
  }
  const size_t L = plan->layers.size();
  TORCH_CHECK(cos.size() == L && sin.size() == L && k.size() == L && v.size() == L && codes.size() == L &&
                  probs.size() == L && full.size() == 5 && sliding.size() == 5,
              "run: one of each per layer, five group inputs");
  const int64_t n = x.size(0), H = plan->H, Hkv = plan->Hkv, D = plan->D;
  const double eps = plan->eps;
  const torch::Tensor& none = empty_tensor();
  x = x.contiguous();
  for (size_t l = 0; l < L; ++l) {
    const Layer& layer = plan->layers[l];
    const std::vector<torch::Tensor>& g = layer.window ? sliding : full;
    ask_for_keys(k[l], v[l], g[0], g[1]);
    torch::Tensor qkv = product(layer.products[0], plan->norm(x, layer.attn_norm, eps), none, int8);
    plan->step(qkv, layer.bias, layer.q_norm, layer.k_norm, eps, cos[l], sin[l], k[l], v[l], g[4], H, Hkv);
    torch::Tensor q = qkv.view({n, H + 2 * Hkv, D}).slice(1, 0, H);
    torch::Tensor out = plan->attend(q, k[l], v[l], g[0], g[1], g[2], g[3], layer.window, probs[l], hk, hv,
                                     codes[l], 0);
    x = product(layer.products[1], out, x, int8);
    torch::Tensor gate_up = product(layer.products[2], plan->norm(x, layer.mlp_norm, eps), none, int8);
    x = product(layer.products[3], plan->silu(gate_up), x, int8);
  }
  return x;
}
"""
)

FUNCTIONS = ["bind", "unbind", "run"]


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None (disabled, or it could not be built: a warning says why)."""
    return build("kvos_step_v2", _SOURCE, FUNCTIONS, ["-O2"], "the decode plan's Python loop")


def module() -> Any:
    """The compiled module, where :func:`kernel` built it."""
    built = kernel()
    assert built is not None, "the step kernel is not built"
    return built
