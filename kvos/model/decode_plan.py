"""A decode step's layers with nothing between the kernels but the calls: each layer's products bound once.

:meth:`Transformer._layers <kvos.model.transformer.Transformer._layers>` goes through the generic seams for
every product (:mod:`kvos.model.linear`: the weight's kind, the activations' dtype and layout, the mode, the
residual's shape) and for the attention (the batch's items, the decode group, the pool's checks): about 55 us
of Python a layer, 1.65 ms a token on SmolLM2's 30 layers, against 7.97 ms of kernels at 2 threads. When a
step is decode steps only (one new token per sequence, each over its cache) and every kernel is there, a
:class:`DecodePlan` runs the layers instead: the products are closures over their kernel and tensors, made
once per model (each checked to take this step's rows), and a layer is nine calls: RMSNorm, QKV product,
``qkv_step``, decode attention, O product with the residual, RMSNorm, gate/up product, SwiGLU, down product
with the residual (Gemma 3: the O and down products' outputs normed before the residual adds them, a GELU
gate, each layer's rotary tables; a mixture of experts in place of the three MLP calls). The results are
those of the generic path (the same kernels in the same order). Where every layer's products have a kernel
reachable by address and the layer is the plain one (SwiGLU, no norms after the products, no experts), the
nine calls of every layer run as one call of :mod:`kvos.model.step_kernel`, without the GIL.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvos.model import activations, decode_kernel, layer_kernel, step_kernel
from kvos.model.attention import Batch, DecodeGroup
from kvos.model.linear import Weight, addmm, matmul
from kvos.model.quant import KernelProduct

if TYPE_CHECKING:
    from kvos.model.experts import Experts
    from kvos.model.transformer import KVStore, LayerWeights, Transformer

EMPTY = torch.empty(0)
# a decode group, its kernel inputs (slots, lengths, key positions, positions) and its rows' write slots
_GroupInputs = tuple[DecodeGroup, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SMALL_N = 32  # the most rows a step may have here: the product kernels' limit (kvos.model.quant, gguf_weight)


def bind(weight: Weight) -> KernelProduct:
    """The weight's product as one call: its kernel with its tensors bound where it has one
    (``kernel_product``: quantized weights on the CPU, and stacks of them), else the generic seam
    (:mod:`kvos.model.linear`: dense weights, no kernel built)."""
    bound = None if isinstance(weight, torch.Tensor) else weight.kernel_product()
    if bound is not None:
        return bound
    return lambda x, c, int8: matmul(x, weight) if c.numel() == 0 else addmm(c, x, weight)


@dataclass(frozen=True)
class PlannedLayer:
    """One layer's weights as the plan calls them."""

    attn_norm: torch.Tensor
    qkv: KernelProduct
    bias: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: KernelProduct
    mlp_norm: torch.Tensor
    gate_up: KernelProduct | None
    down: KernelProduct | None
    window: int
    post_attn_norm: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None
    experts: Experts | None


class DecodePlan:
    """The layers of ``model`` bound for decode steps (see the module docstring); :meth:`of` says whether the
    model can have one."""

    def __init__(self, model: Transformer, layers: Sequence[PlannedLayer]) -> None:
        self.layers = list(layers)
        c = model.config
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.gate = model.gate
        self.silu = c.hidden_act == "silu"
        self.native = _bind_native(self, model)  # the layers bound in C++ (step_kernel), where they can be

    @classmethod
    def of(cls, model: Transformer) -> DecodePlan | None:
        """The plan of a float32 model without an output bias; None otherwise (the generic path then runs
        every step)."""
        if model.dtype != torch.float32 or any(
            layer.o_bias is not None or layer.gate is not None or layer.mixer is not None
            for layer in model.layers
        ):
            return None
        return cls(model, [_planned(model, i, layer) for i, layer in enumerate(model.layers)])

    def takes(self, x: torch.Tensor, meta: Batch, kv: KVStore) -> bool:
        """Whether this step is the plan's: decode steps only, few enough rows for the product kernels,
        float32 rows and a float32 or float16 pool on the CPU with the layer and decode kernels built, no
        query capture (the recovery signal's queries)."""
        group = meta.decodes
        if group is None or len(group.items) != len(meta.metas) or x.shape[0] > SMALL_N:
            return False
        if not layer_kernel.usable(x) or any(m.query_layers for m in meta.metas):
            return False
        k_slab = kv.slabs(0)[0]
        return decode_kernel.usable(x, k_slab) and k_slab.is_contiguous()

    def run(
        self,
        x: torch.Tensor,
        tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: Batch,
        kv: KVStore,
    ) -> torch.Tensor:
        """x [n, hidden] (the embedded tokens), each layer's rotary (cos, sin) [n, 1, D] -> the last layer's
        output [n, hidden] (before the final norm), as the generic layer loop computes it; attention
        probabilities captured where the metadata asks."""
        group = meta.decodes
        assert group is not None
        full = (group, group.kernel_inputs(), meta.write_slots)
        sliding = full
        if meta.window is not None:  # the window layers read what they still hold, at their window slots
            assert meta.window.decodes is not None
            sliding = (meta.window.decodes, meta.window.decodes.kernel_inputs(), meta.window.write_slots)
        heads = kv.head_store().flat() if group.per_head else (EMPTY, EMPTY)  # tokens kept per KV head
        captured = [row for row, m in enumerate(group.metas) if m.capture_layers]
        if self.native is not None:
            return self._run_native(x.contiguous(), tables, full, sliding, heads, captured, kv)
        kernels = layer_kernel.module()
        norm, step, silu = kernels.rms_norm, kernels.qkv_step, kernels.silu_mul
        attend = decode_kernel.module().attend
        int8, eps, h, hkv, d = activations.int8(), self.eps, self.heads, self.kv_heads, self.head_dim
        n = int(x.shape[0])
        x = x.contiguous()
        for index, layer in enumerate(self.layers):
            group, (slots, lengths, key_positions, positions), write_slots = sliding if layer.window else full
            k_slab, v_slab = kv.slabs(index)
            qkv = layer.qkv(norm(x, layer.attn_norm, eps), EMPTY, int8)
            norms, (cos, sin) = (layer.q_norm, layer.k_norm), tables[index]
            step(qkv, layer.bias, *norms, eps, cos, sin, k_slab, v_slab, write_slots, h, hkv)
            wanted = [(row, group.metas[row]) for row in captured if index in group.metas[row].capture_layers]
            probs = torch.zeros(n, h, slots.shape[1]) if wanted else EMPTY
            q = qkv.view(n, h + 2 * hkv, d)[:, :h]
            codes = group.head_codes(index)
            out = attend(
                q,
                k_slab,
                v_slab,
                slots,
                lengths,
                key_positions,
                positions,
                layer.window,
                probs,
                *heads,
                codes,
                0,
            )
            for row, m in wanted:
                m.captured[index] = probs[row, :, : group.lengths[row]]
            if layer.post_attn_norm is None:
                x = layer.o(out, x, int8)
            else:
                x = x + norm(layer.o(out, EMPTY, int8), layer.post_attn_norm, eps)
            if layer.experts is not None:  # as the generic path: the mixture, added
                mixed = layer.experts(norm(x, layer.mlp_norm, eps), self.gate)
                x = x + (mixed if layer.post_mlp_norm is None else norm(mixed, layer.post_mlp_norm, eps))
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate_up = layer.gate_up(norm(x, layer.mlp_norm, eps), EMPTY, int8)
            gated = silu(gate_up) if self.silu else self.gate(gate_up)
            if layer.post_mlp_norm is None:
                x = layer.down(gated, x, int8)
            else:
                x = x + norm(layer.down(gated, EMPTY, int8), layer.post_mlp_norm, eps)
        return x

    def _run_native(
        self,
        x: torch.Tensor,
        tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
        full: _GroupInputs,
        sliding: _GroupInputs,
        heads: tuple[torch.Tensor, torch.Tensor],
        captured: list[int],
        kv: KVStore,
    ) -> torch.Tensor:
        """:meth:`run`'s loop as one call of :mod:`kvos.model.step_kernel`: each layer's slabs, tables,
        head codes and capture buffers gathered first, the probabilities handed to the rows after."""
        assert self.native is not None
        n, h = int(x.shape[0]), self.heads
        k_slabs, v_slabs = kv.slab_lists()
        probs, codes, wanted = [], [], []
        for index, layer in enumerate(self.layers):
            group, inputs, _ = sliding if layer.window else full
            rows = [(row, group) for row in captured if index in group.metas[row].capture_layers]
            probs.append(torch.zeros(n, h, inputs[0].shape[1]) if rows else EMPTY)
            codes.append(group.head_codes(index))
            wanted.append(rows)
        x = step_kernel.module().run(
            self.native,
            x,
            [cos for cos, _ in tables],
            [sin for _, sin in tables],
            k_slabs,
            v_slabs,
            [*full[1], full[2]],
            [*sliding[1], sliding[2]],
            *heads,
            codes,
            probs,
            activations.int8(),
        )
        for index, rows in enumerate(wanted):
            for row, group in rows:
                group.metas[row].captured[index] = probs[index][row, :, : group.lengths[row]]
        return x


def _bind_native(plan: DecodePlan, model: Transformer) -> int | None:
    """``plan``'s layers bound in :mod:`kvos.model.step_kernel` (its handle, freed with the plan), or None:
    the kernels not all built, or a layer the C++ loop does not run (a mixture of experts, Gemma 3's norms
    after the O and down products, a GELU gate, a product without a kernel: dense weights)."""
    built, layers, decodes = step_kernel.kernel(), layer_kernel.kernel(), decode_kernel.kernel()
    if built is None or layers is None or decodes is None or not plan.silu:
        return None
    norms: list[torch.Tensor] = []
    windows, parts, part_tensors = [], [], []
    for index, (weights, planned) in enumerate(zip(model.layers, plan.layers, strict=True)):
        if any(part is not None for part in (planned.experts, planned.post_attn_norm, planned.post_mlp_norm)):
            return None
        for k, weight in enumerate((weights.qkv, weights.o, weights.gate_up, weights.down)):
            native = None if weight is None or isinstance(weight, torch.Tensor) else weight.native_parts()
            if native is None:
                return None
            for i8, f32, arg, tensors in native:
                parts.append([4 * index + k, i8, f32, arg])
                part_tensors.append(tensors)
        norms += [planned.attn_norm, planned.bias, planned.q_norm, planned.k_norm, planned.mlp_norm]
        windows.append(planned.window)
    entries = [*layers.entries(), *decodes.entries()]
    dims = [plan.heads, plan.kv_heads, plan.head_dim]
    handle = int(built.bind(norms, windows, parts, part_tensors, entries, dims, plan.eps))
    weakref.finalize(plan, built.unbind, handle)
    return handle


def _planned(model: Transformer, index: int, layer: LayerWeights) -> PlannedLayer:
    return PlannedLayer(
        attn_norm=layer.attn_norm,
        qkv=bind(layer.qkv),
        bias=EMPTY if layer.qkv_bias is None else layer.qkv_bias,
        q_norm=EMPTY if layer.q_norm is None else layer.q_norm,
        k_norm=EMPTY if layer.k_norm is None else layer.k_norm,
        o=bind(layer.o),
        mlp_norm=layer.mlp_norm,
        gate_up=None if layer.gate_up is None else bind(layer.gate_up),
        down=None if layer.down is None else bind(layer.down),
        window=model.config.window(index) or 0,
        post_attn_norm=layer.post_attn_norm,
        post_mlp_norm=layer.post_mlp_norm,
        experts=layer.experts,
    )
