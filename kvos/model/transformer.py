"""A Llama-family decoder whose attention reads K/V through the KV pool.

Weights are plain tensors (no nn.Module machinery on the hot path) in torch's [out, in] layout, and a
projection plus residual is one ``addmm``; or, from a quantized GGUF file,
:class:`~kvos.model.quant.QuantizedWeight` matrices that stay quantized (:mod:`kvos.model.linear` is the
seam: the embedding, every projection and the head accept either). Q, K and V are fused into one
matrix, as are the MLP's gate and up projections: fewer, larger matmuls per layer. Single-token decode is
dominated by per-op overhead on small models, so op count matters as much as FLOPs.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

from kvos.errors import ModelLoadError, UnsupportedModelError
from kvos.model import decode_kernel, layer_kernel
from kvos.model.attention import (
    AttentionMetadata,
    Batch,
    BatchItem,
    DecodeGroup,
    HeadKVStore,
    grouped_decode_attention,
    mixed_attention,
    paged_attention,
)
from kvos.model.config import ModelConfig
from kvos.model.decode_plan import DecodePlan
from kvos.model.delta_net import DeltaNet
from kvos.model.experts import Experts, SharedExpert
from kvos.model.linear import Weight, addmm, embedding, fuse, logits, matmul, stored
from kvos.model.recurrent import MixerState
from kvos.model.rope import LayerRopes, Rope
from kvos.model.short_conv import ShortConv

if TYPE_CHECKING:
    from kvos.model.weight_arena import Arena


class KVStore(Protocol):
    """What the model needs from a KV pool (satisfied by ``kvos.memory.KVPool``)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def slabs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def slab_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`slabs` of every layer: (K views, V views)."""
        ...

    def head_store(self) -> HeadKVStore:
        """Where the K/V of tokens kept per KV head are (``kvos.memory.head_store.HeadStore``)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """What K and V are kept in (a float32 model may keep them in float16)."""
        ...


class _NoStore:
    """A KV store that keeps nothing: for standalone forward passes (attention uses the fresh K/V)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        return None

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a standalone forward pass never reads cached K/V")

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a standalone forward pass never reads cached K/V")

    def slabs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a standalone forward pass never reads cached K/V")

    def slab_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        raise AssertionError("a standalone forward pass never reads cached K/V")

    def head_store(self) -> HeadKVStore:
        raise AssertionError("a standalone forward pass never reads cached K/V")

    @property
    def dtype(self) -> torch.dtype:
        raise AssertionError("a standalone forward pass keeps no K/V")


NO_STORE = _NoStore()


@dataclass
class LayerWeights:
    """One decoder layer, projections [out, in]: qkv [(H + 2 Hkv) * D, hidden], o [hidden, H * D],
    gate_up [2 * inter, hidden], down [hidden, inter]; norms [hidden] (q/k norms [D]). ``post_attn_norm``
    and ``post_mlp_norm`` (Gemma's sandwich) norm the attention's and the MLP's outputs before the residual
    adds them. A mixture-of-experts layer has ``experts`` in place of ``gate_up`` and ``down``. ``gate``
    [H * D, hidden] gates the attention's output by its sigmoid (Qwen3.5). A hybrid model's recurrent layer
    has ``mixer`` (a gated delta-net, :class:`~kvos.model.delta_net.DeltaNet`, or a short convolution,
    :class:`~kvos.model.short_conv.ShortConv`) in place of attention: its ``qkv`` is the mixer's fused input
    projection and ``o`` its output projection; it has no q/k norms."""

    attn_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: Weight | None
    down: Weight | None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    experts: Experts | None = None
    gate: Weight | None = None
    mixer: DeltaNet | ShortConv | None = None

    def projections(self) -> list[Weight]:
        """The layer's projections other than a mixture's experts, in the order a decode step reads them:
        QKV, the output gate, O, gate/up, down (those it has)."""
        return [w for w in (self.qkv, self.gate, self.o, self.gate_up, self.down) if w is not None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back, as the reference implementations do
    (rows [n, d] of float32 on the CPU in :mod:`kvos.model.layer_kernel`)."""
    if x.dim() == 2 and layer_kernel.usable(x) and weight.dtype == torch.float32:
        return layer_kernel.module().rms_norm(x.contiguous(), weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Transformer:
    """Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 decoder over a paged KV store.

    Norm weights are the scale each norm applies: Gemma's ``1 + w`` is added up front by whoever reads its
    checkpoint (as llama.cpp's converter writes it into GGUF files), so every norm is one RMSNorm here. A
    query scale other than ``head_dim ** -0.5`` (Gemma's ``query_pre_attn_scalar``) is folded into the query
    norm's weights: the attention kernels keep their one scale."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight]) -> None:
        self.config = config
        self.source: Path | None = None  # the file or directory it was loaded from (load_model)
        self.arena: Arena | None = None  # where load_model moved the projections (kvos.model.weight_arena)
        self.embed = _need(weights, "model.embed_tokens.weight")
        self.final_norm = _dense(weights, "model.norm.weight")
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        head = weights.get("lm_head.weight")
        if head is None and not config.tie_word_embeddings:
            raise ModelLoadError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        self.lm_head = self.embed if head is None or config.tie_word_embeddings else head
        self.layers = [_layer(config, weights, i) for i in range(config.num_layers)]
        # Everything past the layers counts attention layers only: the pool's layer j is kv_layers[j].
        thetas, scalings = zip(*(config.rope_of(i) for i in config.kv_layers), strict=True)
        self.ropes = LayerRopes.of(config.head_dim, thetas, scalings, config.rotary_dim)
        self.windows = [config.window(i) for i in config.kv_layers]
        self.kv_index = {layer: j for j, layer in enumerate(config.kv_layers)}
        self.embed_scale = None
        if config.embedding_multiplier is not None:  # as transformers: a float32 scalar cast to the dtype
            self.embed_scale = torch.tensor(config.embedding_multiplier, dtype=torch.float32).to(self.dtype)
        _fold_query_scale(config, self.layers)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVStore,
        logits: Literal["last", "all", "none"] = "last",
    ) -> torch.Tensor:
        """token_ids: int64 [n] -> logits float32 [1, vocab] ("last"), [n, vocab] ("all"),
        or the final hidden states [n, hidden] ("none")."""
        return self.forward_batch([BatchItem(token_ids, meta, logits)], kv)[0]

    @torch.inference_mode()
    def forward_batch(self, items: Seq[BatchItem], kv: KVStore) -> list[torch.Tensor]:
        """One forward pass over the new tokens of several sequences (prefill slices and decode tokens
        mixed): the projections and the MLP run once over all rows [sum n_i, hidden], attention runs per
        sequence over its own keys. Returns one output per item, as :meth:`forward` would have returned
        for that item alone."""
        batch = Batch.of(list(items))
        x = self._layers(batch.token_ids, batch.positions, batch, kv)
        outputs = [x[lo:hi] for lo, hi in pairwise(batch.bounds)]  # "none": the hidden states
        heads = [i for i, item in enumerate(items) if item.logits != "none"]
        rows = [outputs[i] if items[i].logits == "all" else outputs[i][-1:] for i in heads]
        if rows:
            logits = self.head(rows[0] if len(rows) == 1 else torch.cat(rows))
            for i, part in zip(heads, logits.split([int(r.shape[0]) for r in rows]), strict=True):
                outputs[i] = part
        return outputs

    def _layers(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: Batch,
        kv: KVStore,
    ) -> torch.Tensor:
        """token_ids int64 [n], positions int64 [n] -> final hidden states [n, hidden] (normed)."""
        x = self.embed_tokens(token_ids)
        tables = {id(r): r.cos_sin(positions, self.dtype, self.device) for r, _ in self.ropes.groups()}
        eps = self.config.rms_norm_eps
        if kv is not NO_STORE:
            plan = self.decode_plan
            if plan is not None and plan.takes(x, meta, kv):
                per_layer = [tables[id(rope)] for rope in self.ropes.per_layer]
                return rms_norm(plan.run(x, per_layer, meta, kv), self.final_norm, eps)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, eps)
            mixer = layer.mixer
            if mixer is not None:
                x = addmm(x, self._recurrent(i, mixer, h, meta), layer.o)
                x = self._mlp(layer, x, eps)
                continue
            j = self.kv_index[i]
            cos, sin = tables[id(self.ropes[j])]
            seen = meta.window if meta.window and self.windows[j] else meta
            out = self._attention(j, layer, h, cos, sin, seen, kv)
            if layer.gate is not None:
                out = out * torch.sigmoid(matmul(h, layer.gate))
            if layer.o_bias is not None:
                x = x + layer.o_bias
            if layer.post_attn_norm is None:
                x = addmm(x, out, layer.o)
            else:
                x = x + rms_norm(matmul(out, layer.o), layer.post_attn_norm, eps)
            x = self._mlp(layer, x, eps)
        return rms_norm(x, self.final_norm, eps)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, eps: float) -> torch.Tensor:
        """The residual stream x [n, hidden] after the layer's MLP (or mixture of experts) adds to it."""
        h = rms_norm(x, layer.mlp_norm, eps)
        if layer.experts is not None:
            out = layer.experts(h, self.gate)
        else:
            assert layer.gate_up is not None and layer.down is not None
            gated = self.gate(matmul(h, layer.gate_up))
            if layer.post_mlp_norm is None:
                return addmm(x, gated, layer.down)
            out = matmul(gated, layer.down)
        return x + (out if layer.post_mlp_norm is None else rms_norm(out, layer.post_mlp_norm, eps))

    def _recurrent(
        self, index: int, mixer: DeltaNet | ShortConv, h: torch.Tensor, meta: Batch
    ) -> torch.Tensor:
        """A recurrent layer (gated delta-net, short convolution) over h [n, hidden] (normed): each
        sequence's rows from its state (``meta.recurrent``, zeros where it has none), the states after them
        staged there -> the layer's output before its output projection [n, ...]."""
        proj = mixer.project(h)
        states = []
        for m in meta.metas:
            state = None if m.recurrent is None else m.recurrent.layers.get(index)
            states.append(mixer.empty_state() if state is None else state)
        bounds = list(pairwise(meta.bounds))
        outs: list[torch.Tensor | None] = [None] * len(bounds)
        afters: list[MixerState | None] = [None] * len(bounds)
        steps = [i for i, (lo, hi) in enumerate(bounds) if hi - lo == 1]
        if steps:  # the decode steps together (one, or several sequences')
            rows = torch.tensor([bounds[i][0] for i in steps], device=proj.device)
            stepped, stepped_states = mixer.run_decodes(proj[rows], [states[i] for i in steps])
            for j, i in enumerate(steps):
                outs[i], afters[i] = stepped[j : j + 1], stepped_states[j]
        for i, (lo, hi) in enumerate(bounds):
            if outs[i] is None:
                outs[i], afters[i] = mixer.run(proj[lo:hi], states[i])
        for m, state_after, (lo, hi) in zip(meta.metas, afters, bounds, strict=True):
            if m.recurrent is not None and state_after is not None:
                m.recurrent.stage(index, state_after, hi - lo)
        done = [o for o in outs if o is not None]
        return done[0] if len(done) == 1 else torch.cat(done)

    def recurrent_state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (a hybrid model's delta-nets and short convolutions; 0 for
        a model without them), whatever the sequence's length."""
        return sum(layer.mixer.empty_state().nbytes for layer in self.layers if layer.mixer is not None)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids int64 [n] -> the embedded rows [n, hidden], scaled where the model scales them."""
        x = embedding(token_ids.to(self.device), self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

    def gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's gated activation: gate_up [n, 2 * inter] -> [n, inter] (SwiGLU, or GELU-tanh)."""
        if self.config.hidden_act == "silu":
            return swiglu(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @cached_property
    def decode_plan(self) -> DecodePlan | None:
        """The layers bound for decode steps (:mod:`kvos.model.decode_plan`), made on first use; None where
        the model cannot have one."""
        return DecodePlan.of(self)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] -> float32 logits [n, vocab] (soft-capped where the model caps
        them: ``cap * tanh(logits / cap)``)."""
        out = logits(hidden, self.lm_head)
        cap = self.config.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap

    @torch.inference_mode()
    def first_queries(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's queries of ``token_ids`` (int64 [n]) as at position 0, before any rotation:
        no attention runs before them, so they depend on the tokens alone -> float32 [n, heads, head_dim]."""
        c, layer = self.config, self.layers[0]
        if layer.mixer is not None or layer.gate is not None:
            raise UnsupportedModelError("the first-layer query signal needs a plain attention first layer")
        h = rms_norm(self.embed_tokens(token_ids), layer.attn_norm, c.rms_norm_eps)
        qkv = matmul(h, layer.qkv) if layer.qkv_bias is None else addmm(layer.qkv_bias, h, layer.qkv)
        q = qkv.view(h.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)[:, : c.num_heads]
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
        return q.float()

    def _attention(
        self,
        index: int,
        layer: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: Batch,
        kv: KVStore,
    ) -> torch.Tensor:
        """h: [n, hidden] -> attention output [n, H * D], before the output projection. ``index`` is the
        pool's layer (:attr:`kv_index` of the model's)."""
        slabs = None
        if layer_kernel.usable(h):
            q, k, v, slabs = self._qkv_fused(index, layer, h, cos, sin, meta, kv)
        else:
            q, k, v = self._qkv(layer, h, cos, sin)
            kv.write(index, meta.write_slots, k, v)
        group, together = meta.decodes, {}
        decoded = None if group is None else self._attend_decodes(index, q, group, kv, slabs)
        if group is not None and decoded is not None:
            if len(group.items) == len(meta.metas):
                return decoded  # every item a decode step: its rows are the items' in order
            together = {i: decoded[r : r + 1] for r, i in enumerate(group.items)}
        outs = [
            together[i] if i in together else self._attend(index, q[lo:hi], k[lo:hi], v[lo:hi], m, kv)
            for i, (m, (lo, hi)) in enumerate(zip(meta.metas, pairwise(meta.bounds), strict=True))
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _qkv(
        self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [n, hidden] -> q [n, H, D], k and v [n, Hkv, D]: projected, biased, q/k-normed and rotated,
        in eager ops."""
        c = self.config
        qkv = matmul(h, layer.qkv) if layer.qkv_bias is None else addmm(layer.qkv_bias, h, layer.qkv)
        qkv = qkv.view(h.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk, v = qkv[:, : c.num_heads + c.num_kv_heads], qkv[:, c.num_heads + c.num_kv_heads :]
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat(
                (
                    rms_norm(qk[:, : c.num_heads], layer.q_norm, c.rms_norm_eps),
                    rms_norm(qk[:, c.num_heads :], layer.k_norm, c.rms_norm_eps),
                ),
                dim=1,
            )
        qk = Rope.apply(qk, cos, sin)  # queries and keys rotated together: one pass
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _qkv_fused(
        self,
        index: int,
        layer: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: Batch,
        kv: KVStore,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """:meth:`_qkv` and the pool write in one kernel call after the product
        (:mod:`kvos.model.layer_kernel`): the same q, k, v, with k and v written to ``meta.write_slots``; and
        the pool layer's slabs (None for a standalone pass)."""
        c = self.config
        module, empty = layer_kernel.module(), layer_kernel.EMPTY
        qkv = matmul(h, layer.qkv).contiguous()
        k_slab, v_slab = (empty, empty) if kv is NO_STORE else kv.slabs(index)
        direct = layer_kernel.writes_into(k_slab)
        module.qkv_step(
            qkv,
            empty if layer.qkv_bias is None else layer.qkv_bias,
            empty if layer.q_norm is None else layer.q_norm,
            empty if layer.k_norm is None else layer.k_norm,
            c.rms_norm_eps,
            cos,
            sin,
            k_slab if direct else empty,
            v_slab if direct else empty,
            meta.write_slots,
            c.num_heads,
            c.num_kv_heads,
        )
        qkv = qkv.view(h.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split((c.num_heads, c.num_kv_heads, c.num_kv_heads), dim=1)
        if not direct and kv is not NO_STORE:
            kv.write(index, meta.write_slots, k, v)
        return q, k, v, None if kv is NO_STORE else (k_slab, v_slab)

    def _attend_decodes(
        self,
        index: int,
        q: torch.Tensor,
        group: DecodeGroup,
        kv: KVStore,
        slabs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The decode items of a batch attend together, straight from the pool where the decode kernel
        runs (:mod:`kvos.model.decode_kernel`), else over one padded gather of their keys (with at least
        two of them; one alone takes :meth:`_attend`). q: [rows, H, D] of the whole batch -> [items, H * D],
        a row for each of ``group.items`` in order; None when the items are left to :meth:`_attend`."""
        c = self.config
        k_slab, v_slab = kv.slabs(index) if slabs is None else slabs
        fast = decode_kernel.usable(q, k_slab)
        if not fast and (len(group.items) == 1 or group.per_head):
            return None  # (the gathered path reads whole tokens only: per-head ones go to _attend)
        for meta, row in zip(group.metas, group.rows, strict=True):
            if index in meta.query_layers:
                seen, mine = meta.queries.get(index), q[row : row + 1].float()
                meta.queries[index] = mine if seen is None else torch.cat((seen, mine))
        every = len(group.rows) == q.shape[0]  # every row a decode step (rows distinct, ascending)
        mine = q if every else q[group.rows]
        if fast:
            heads = kv.head_store().flat() if group.per_head else (decode_kernel.EMPTY, decode_kernel.EMPTY)
            window = self.windows[index]
            return decode_kernel.decode_attention(mine, k_slab, v_slab, group, window, index, heads)
        keys, values = kv.gather_rows(index, group.head_rows(c.num_kv_heads))  # [B * Hkv * T, D]
        shape = (len(group.items) * c.num_kv_heads, -1, c.head_dim)
        window = self.windows[index]
        return grouped_decode_attention(mine, keys.view(shape), values.view(shape), group, window, index)

    def _attend(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVStore,
    ) -> torch.Tensor:
        """One sequence's attention: q [n, H, D] and its new k, v [n, Hkv, D] (already written to the
        pool) -> [n, H * D]."""
        if index in meta.query_layers:
            seen = meta.queries.get(index)
            meta.queries[index] = q.float() if seen is None else torch.cat((seen, q.float()))
        if meta.fresh:  # the new keys as the pool holds them: rounded where it holds fewer bits
            keys, values = (k, v) if kv is NO_STORE else (as_stored(k, kv), as_stored(v, kv))
        else:
            keys, values = kv.gather(index, meta.read_slots)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if meta.heads is not None:
            return mixed_attention(q, keys, values, meta, kv.head_store(), self.windows[index], index)
        return paged_attention(q, keys, values, meta, self.windows[index], index)


def as_stored(x: torch.Tensor, kv: KVStore) -> torch.Tensor:
    """``x`` as the pool ``kv`` would give it back: rounded to the pool's dtype (float16, say) and widened
    again, so that a prefill attends to the same values as the decode steps after it; ``x`` itself when
    the pool holds its dtype."""
    return x if kv.dtype == x.dtype else x.to(kv.dtype).to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2 * inter] (the gate, then the up projection) -> silu(gate) * up [n, inter]."""
    if gate_up.dim() == 2 and layer_kernel.usable(gate_up):
        return layer_kernel.module().silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _need(weights: Mapping[str, Weight], name: str) -> Weight:
    try:
        return weights[name]
    except KeyError:
        raise ModelLoadError(f"checkpoint is missing tensor {name!r}") from None


def _dense(weights: Mapping[str, Weight], name: str) -> torch.Tensor:
    """A tensor that must be dense (norms, biases)."""
    value = _need(weights, name)
    if not isinstance(value, torch.Tensor):
        raise ModelLoadError(f"tensor {name!r} must be a dense tensor, not a quantized matrix")
    return value


def _dense_or_dequantized(weights: Mapping[str, Weight], name: str) -> torch.Tensor:
    """A tensor used dense: a quantized one is dequantized (a router is small and read in float32)."""
    value = _need(weights, name)
    return value if isinstance(value, torch.Tensor) else value.dequantize()


def _dense_or_none(weights: Mapping[str, Weight], name: str) -> torch.Tensor | None:
    return _dense(weights, name) if name in weights else None


def _fold_query_scale(config: ModelConfig, layers: Seq[LayerWeights]) -> None:
    """Scale the query norms by sqrt(head_dim / query_pre_attn_scalar), so that attention's
    ``head_dim ** -0.5`` gives the model's ``query_pre_attn_scalar ** -0.5``."""
    scalar = config.query_pre_attn_scalar
    if scalar is None or scalar == config.head_dim:
        return
    ratio = (config.head_dim / scalar) ** 0.5
    for layer in layers:
        if layer.q_norm is None:
            raise ModelLoadError("a query scale of its own needs the query norm to carry it")
        layer.q_norm = layer.q_norm * ratio


def _layer(config: ModelConfig, w: Mapping[str, Weight], i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    sandwich = config.sandwich_norms
    experts = _experts(config, w, i) if config.moe(i) else None
    mlp_norm = _dense(w, f"{p}{'pre_feedforward' if sandwich else 'post_attention'}_layernorm.weight")
    gate_up = None
    if experts is None:
        gate_up = fuse([_need(w, f"{p}mlp.gate_proj.weight"), _need(w, f"{p}mlp.up_proj.weight")])
    down = None if experts else stored(_need(w, f"{p}mlp.down_proj.weight"))
    post_mlp_norm = _dense(w, f"{p}post_feedforward_layernorm.weight") if sandwich else None
    mixer: DeltaNet | ShortConv | None = None
    if i in config.conv_layers:
        mixer, out = _short_conv(w, f"{p}conv."), f"{p}conv.out_proj.weight"
    elif i in config.linear_layers:
        mixer, out = _delta_net(config, w, i), f"{p}linear_attn.out_proj.weight"
    if mixer is not None:  # a recurrent layer: its mixer in place of attention
        return LayerWeights(
            attn_norm=_dense(w, f"{p}input_layernorm.weight"),
            qkv=mixer.in_proj,
            qkv_bias=None,
            o=stored(_need(w, out)),
            o_bias=None,
            q_norm=None,
            k_norm=None,
            mlp_norm=mlp_norm,
            gate_up=gate_up,
            down=down,
            post_mlp_norm=post_mlp_norm,
            experts=experts,
            mixer=mixer,
        )
    q, k, v = (_need(w, f"{p}self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj"))
    bias = None
    if config.attention_bias or f"{p}self_attn.q_proj.bias" in w:
        names = ("q_proj", "k_proj", "v_proj")
        bias = torch.cat([_dense(w, f"{p}self_attn.{n}.bias") for n in names])
    q_norm = _dense(w, f"{p}self_attn.q_norm.weight") if config.qk_norm else None
    k_norm = _dense(w, f"{p}self_attn.k_norm.weight") if config.qk_norm else None
    gate = _need(w, f"{p}self_attn.gate_proj.weight") if config.attn_output_gate else None
    return LayerWeights(
        attn_norm=_dense(w, f"{p}input_layernorm.weight"),
        qkv=fuse([q, k, v]),
        qkv_bias=bias,
        o=stored(_need(w, f"{p}self_attn.o_proj.weight")),
        o_bias=_dense_or_none(w, f"{p}self_attn.o_proj.bias"),
        q_norm=q_norm,
        k_norm=k_norm,
        post_attn_norm=_dense(w, f"{p}post_attention_layernorm.weight") if sandwich else None,
        mlp_norm=mlp_norm,
        gate_up=gate_up,
        down=down,
        post_mlp_norm=post_mlp_norm,
        experts=experts,
        gate=None if gate is None else stored(gate),
    )


def _short_conv(w: Mapping[str, Weight], p: str) -> ShortConv:
    """A short-convolution layer's mixer (LFM2; names under ``p``: ``in_proj``, ``conv``)."""
    conv = _dense(w, f"{p}conv.weight")
    return ShortConv(
        in_proj=stored(_need(w, f"{p}in_proj.weight")),
        conv=conv.reshape(conv.shape[0], -1),
        bias=_dense_or_none(w, f"{p}conv.bias"),
    )


def _delta_net(config: ModelConfig, w: Mapping[str, Weight], i: int) -> DeltaNet:
    """Layer ``i``'s gated delta-net (Hugging Face names: ``linear_attn.*``)."""
    p = f"model.layers.{i}.linear_attn."
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    conv = _dense(w, f"{p}conv1d.weight")
    # -exp(A_log): a GGUF file stores it so (``neg_a`` here), a Hugging Face checkpoint stores A_log
    neg_a = _dense(w, f"{p}neg_a").float() if f"{p}neg_a" in w else -_dense(w, f"{p}A_log").float().exp()
    return DeltaNet(
        in_proj=fuse([_need(w, f"{p}{n}.weight") for n in names]),
        conv=conv.reshape(conv.shape[0], -1),
        neg_a=neg_a,
        dt_bias=_dense(w, f"{p}dt_bias").float(),
        norm=_dense(w, f"{p}norm.weight"),
        key_heads=config.linear_key_heads,
        value_heads=config.linear_value_heads,
        key_dim=config.linear_key_dim,
        value_dim=config.linear_value_dim,
        eps=config.rms_norm_eps,
        tiled=config.linear_heads_tiled,
    )


def _experts(config: ModelConfig, w: Mapping[str, Weight], i: int) -> Experts:
    """Layer ``i``'s router and experts (Hugging Face names: ``mlp.gate`` and ``mlp.experts.E.*``)."""
    p = f"model.layers.{i}.mlp."
    names = range(config.num_experts)
    return Experts(
        router=_dense_or_dequantized(w, f"{p}gate.weight"),
        gate_up=[
            fuse([_need(w, f"{p}experts.{e}.gate_proj.weight"), _need(w, f"{p}experts.{e}.up_proj.weight")])
            for e in names
        ],
        down=[stored(_need(w, f"{p}experts.{e}.down_proj.weight")) for e in names],
        top_k=config.num_experts_per_tok,
        renormalise=config.norm_topk_prob,
        shared=_shared_expert(w, p) if config.shared_expert_intermediate_size else None,
    )


def _shared_expert(w: Mapping[str, Weight], p: str) -> SharedExpert:
    """A layer's shared expert and its gate (Hugging Face names ``mlp.shared_expert.*`` and
    ``mlp.shared_expert_gate``; a GGUF file stores the gate as a vector)."""
    s = f"{p}shared_expert."
    return SharedExpert(
        gate_up=fuse([_need(w, f"{s}gate_proj.weight"), _need(w, f"{s}up_proj.weight")]),
        down=stored(_need(w, f"{s}down_proj.weight")),
        gate=_dense_or_dequantized(w, f"{p}shared_expert_gate.weight").reshape(1, -1),
    )
