"""Where the rows of the Qwen3.5 family's projections go in kvos's layout, for both file formats.

Qwen3.5's ``q_proj`` holds, head by head, the head's query rows and then its output gate's rows; and only the
first quarter of each head's dims rotate. kvos keeps the queries and the gate as two matrices
(``self_attn.q_proj`` and ``self_attn.gate_proj``) and the query and key dims of each head in
:func:`~kvos.model.rope.partial_rotary_order`, so that every kernel that rotates whole heads computes the
partial rotation. Qwen3-Next's delta-nets hold their projections interleaved per key head; kvos keeps them as
Qwen3.5 does (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

Everything here is a choice of rows: :func:`rearranged` takes a ``take(tensor, rows)`` that indexes a Hugging
Face tensor, or a GGUF one's raw rows (quantized rows move whole), so both formats reach the model in one
layout by one routine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvos.errors import UnsupportedModelError
from kvos.model.config import ModelConfig
from kvos.model.rope import partial_rotary_order

T = TypeVar("T")  # a tensor of either format


@dataclass(frozen=True)
class AttentionRows:
    """Row indexes (int64) into a layer's stored projections: ``query`` and ``gate`` into ``q_proj``
    [heads * 2 * head_dim rows], ``key`` into ``k_proj``; ``dims`` reorders a head's dims (the q/k norms)."""

    query: torch.Tensor
    gate: torch.Tensor
    key: torch.Tensor
    dims: torch.Tensor


def applies(config: ModelConfig) -> bool:
    """Whether ``config``'s checkpoints need :func:`rearranged` (a gated or partially rotated attention, or
    Qwen3-Next's interleaved delta-nets)."""
    return config.attn_output_gate or config.rotary_dim is not None or config.model_type == "qwen3_next"


def attention_rows(config: ModelConfig) -> AttentionRows:
    """The orders for ``config`` (``attn_output_gate`` and/or a partial ``rotary_dim``)."""
    d, heads = config.head_dim, config.num_heads
    dims = torch.arange(d) if config.rotary_dim is None else partial_rotary_order(d, config.rotary_dim)
    per_head = 2 * d if config.attn_output_gate else d
    base = torch.arange(heads)[:, None] * per_head
    query = (base + dims[None, :]).reshape(-1)
    gate = (base + d + torch.arange(d)[None, :]).reshape(-1) if config.attn_output_gate else query[:0]
    key = (torch.arange(config.num_kv_heads)[:, None] * d + dims[None, :]).reshape(-1)
    return AttentionRows(query, gate, key, dims)


def rearranged(
    config: ModelConfig, weights: dict[str, T], take: Callable[[T, torch.Tensor], T]
) -> dict[str, T]:
    """``weights`` (Hugging Face names) in kvos's layout (the module docstring): each attention layer's
    ``q_proj`` split into queries and ``gate_proj``, queries, keys and their norms reordered; Qwen3-Next's
    delta-net projections regrouped as Qwen3.5's."""
    rows = attention_rows(config)
    out = dict(weights)
    for layer in config.kv_layers:
        p = f"model.layers.{layer}.self_attn."
        if p + "q_proj.bias" in weights:
            raise UnsupportedModelError("query/key biases with Qwen3.5's gated, partially rotated attention")
        q = weights[p + "q_proj.weight"]
        out[p + "q_proj.weight"] = take(q, rows.query)
        if config.attn_output_gate:
            out[p + "gate_proj.weight"] = take(q, rows.gate)
        out[p + "k_proj.weight"] = take(weights[p + "k_proj.weight"], rows.key)
        for norm in ("q_norm.weight", "k_norm.weight"):
            if p + norm in weights:
                out[p + norm] = take(weights[p + norm], rows.dims)
    if config.model_type == "qwen3_next":
        _split_qwen3_next(config, out, take)
    return out


def _split_qwen3_next(
    config: ModelConfig, weights: dict[str, T], take: Callable[[T, torch.Tensor], T]
) -> None:
    """Qwen3-Next's delta-net projections under Qwen3.5's names, in place: ``in_proj_qkvz`` (a Hugging Face
    checkpoint's) holds, key head by key head, that head's q, k, its value heads' v and z rows, and
    ``in_proj_ba`` (both formats') its value heads' b and a rows; Qwen3.5 keeps all q rows, then all k, then
    all v (``in_proj_qkv``), and z, b, a apart. A GGUF file's converter regrouped q, k, v and z already."""
    hk, dk, dv = config.linear_key_heads, config.linear_key_dim, config.linear_value_dim
    per = config.linear_value_heads // hk
    block = 2 * dk + 2 * per * dv  # one key head's rows of in_proj_qkvz
    heads = torch.arange(hk)[:, None] * block
    q, k = (heads + torch.arange(dk)).reshape(-1), (heads + dk + torch.arange(dk)).reshape(-1)
    v = (heads + 2 * dk + torch.arange(per * dv)).reshape(-1)
    z = (heads + 2 * dk + per * dv + torch.arange(per * dv)).reshape(-1)
    pairs = torch.arange(hk)[:, None] * 2 * per
    b, a = (pairs + torch.arange(per)).reshape(-1), (pairs + per + torch.arange(per)).reshape(-1)
    for layer in config.linear_layers:
        p = f"model.layers.{layer}.linear_attn."
        if p + "in_proj_qkvz.weight" in weights:
            qkvz = weights.pop(p + "in_proj_qkvz.weight")
            weights[p + "in_proj_qkv.weight"] = take(qkvz, torch.cat((q, k, v)))
            weights[p + "in_proj_z.weight"] = take(qkvz, z)
        ba = weights.pop(p + "in_proj_ba.weight")
        weights[p + "in_proj_b.weight"], weights[p + "in_proj_a.weight"] = take(ba, b), take(ba, a)
