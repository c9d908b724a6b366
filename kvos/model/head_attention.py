"""Per-head attention: every KV head of every layer reads its own set of keys.

When heads keep different tokens (per-head budgets), a layer's keys no longer form one list shared by all
heads. The caller (:class:`kvos.engine.head_cache.HeadCache`) passes, per layer, a padded slot index
``[num_kv_heads, T]`` into a head pool, the keys' rotary positions and a validity mask. Keys are stored
after RoPE at their original positions; the causal mask compares positions, so gaps are fine.

Attention is computed explicitly in float32 (softmax of masked scores), which also yields the
probabilities the eviction policies need: per layer, their column sums over every new query (cumulative
attention, H2O) and the rows of the last ``window`` queries (SnapKV's observation window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvos.model.attention import visible


class HeadKVStore(Protocol):
    """What per-head attention needs from a head pool (``kvos.memory.head_pool.HeadPool``)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class HeadCapture:
    """Attention probabilities of one layer, over that layer's padded per-head key lists.

    attn_sum: float32 [num_heads, T], each key's probability summed over every new query (0 where padded).
    window: float32 [w, num_heads, T], the probabilities of the last ``w`` new queries (w <= window).
    Query head ``h`` reads the keys of KV head ``h // group``.
    """

    attn_sum: torch.Tensor
    window: torch.Tensor


@dataclass
class HeadAttentionMetadata:
    """One forward pass over ``n`` new tokens of one sequence whose heads hold different keys.

    positions: int64 [n] rotary positions of the new tokens.
    write_slots: int64 [num_layers, num_kv_heads, n] head-pool slots where each head stores them.
    read_slots: int64 [num_layers, num_kv_heads, T] slots of every key each head reads (new ones included;
        padding entries must still be valid slots).
    key_positions: int64 [num_layers, num_kv_heads, T] rotary positions of those keys.
    valid: bool [num_layers, num_kv_heads, T]: False marks padding.
    capture: record a :class:`HeadCapture` per layer into ``captured``.
    window: how many of the last queries' rows a capture keeps.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    key_positions: torch.Tensor
    valid: torch.Tensor
    capture: bool = False
    window: int = 32
    captured: dict[int, HeadCapture] = field(default_factory=dict)

    @property
    def num_new(self) -> int:
        return int(self.positions.shape[0])


def head_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: HeadAttentionMetadata,
    store: HeadKVStore,
    window: int | None,
    layer: int,
) -> torch.Tensor:
    """Store the new K/V of ``layer`` per head, then attend over each head's own keys.

    q: [n, num_heads, head_dim]; k, v: [n, num_kv_heads, head_dim] (post-RoPE keys).
    ``window``: the layer's sliding window in positions, or None. Returns [n, num_heads * head_dim]
    in q's dtype.
    """
    n, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    store.write(layer, meta.write_slots[layer], k, v)
    keys, values = store.gather(layer, meta.read_slots[layer])  # [Hkv, T, D] each
    t = keys.shape[1]
    qg = q.float().permute(1, 0, 2).reshape(num_kv, group * n, head_dim) * (1.0 / math.sqrt(head_dim))
    scores = torch.bmm(qg, keys.float().transpose(1, 2)).view(num_kv, group, n, t)
    allowed = visible(meta.positions[None, :, None], meta.key_positions[layer][:, None, :], window)
    allowed &= meta.valid[layer][:, None, :]  # [Hkv, n, T]
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    if meta.capture:
        meta.captured[layer] = _capture(probs, meta.window)
    out = torch.bmm(probs.view(num_kv, group * n, t), values.float())  # [Hkv, G * n, D]
    out = out.view(num_kv, group, n, head_dim).permute(2, 0, 1, 3)
    return out.reshape(n, num_heads * head_dim).to(q.dtype)


def _capture(probs: torch.Tensor, window: int) -> HeadCapture:
    """probs [Hkv, G, n, T] -> column sums [H, T] and the last ``window`` rows [w, H, T]."""
    num_kv, group, n, t = probs.shape
    flat = probs.reshape(num_kv * group, n, t)
    w = min(window, n)
    return HeadCapture(attn_sum=flat.sum(dim=1), window=flat[:, n - w :].transpose(0, 1).clone())
