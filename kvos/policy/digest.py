"""Key digests: a few bytes per saved chunk that bound how strongly any query can attend to it.

When a chunk leaves the pool its keys (``[layers, n, kv_heads, head_dim]``, stored after RoPE at their
positions) are rotated back to position 0, and for each chosen layer and KV head the element-wise minimum
and maximum over the chunk's tokens are kept: a box that holds every key of the chunk. For a query ``q``
(also rotated back to position 0) the largest logit any key ``k`` in the box can give is (Quest's bound)::

    max_k q . k  <=  sum_d max(q_d * lo_d, q_d * hi_d)

It holds for every key of the chunk exactly (the box is rounded outwards when stored in float16). It is the
logit at equal rotation, the "content" part of RoPE attention: where the chunk lands is decided later, so
its relative rotation to the query is not known when it is scored.

Size: ``2 * len(layers) * kv_heads * head_dim`` float16 numbers per chunk, against
``2 * num_layers * n * kv_heads * head_dim`` numbers of the model's dtype for its K and V.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvos.errors import ConfigError
from kvos.model.rope import LayerRopes, Rope


@dataclass(frozen=True)
class KeyDigest:
    """The box of one chunk's keys: ``lo`` and ``hi`` float16 ``[len(layers), kv_heads, head_dim]``."""

    layers: tuple[int, ...]
    lo: torch.Tensor
    hi: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.lo.numel() * self.lo.element_size() + self.hi.numel() * self.hi.element_size()


def unrotate(x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate vectors stored at ``positions`` back to position 0.

    x: ``[n, heads, head_dim]`` (any float dtype), positions: int64 ``[n]`` -> float32, x's shape.
    """
    old = positions.to(torch.int64).cpu()
    return Rope.rotate(x.float(), rope.rotation(old, torch.zeros_like(old), x.device))


def digest_keys(
    k: torch.Tensor, positions: torch.Tensor, ropes: LayerRopes, layers: Sequence[int]
) -> KeyDigest:
    """The :class:`KeyDigest` of a chunk's keys ``k`` ``[num_layers, n, kv_heads, head_dim]`` (rotated at
    ``positions``, int64 ``[n]``, each layer by its rope) over ``layers``; ``n`` must be at least 1."""
    chosen = torch.stack([unrotate(k[i], positions, ropes[i]) for i in layers])  # [Ld, n, kv, D]
    lo, hi = chosen.amin(dim=1), chosen.amax(dim=1)
    return KeyDigest(tuple(layers), _round(lo, down=True), _round(hi, down=False))


def _round(x: torch.Tensor, down: bool) -> torch.Tensor:
    """float32 -> float16, rounded towards -inf (``down``) or +inf, so the stored box still holds x."""
    h = x.to(torch.float16)
    towards = torch.full_like(h, float("-inf") if down else float("inf"))
    wrong = h.float() > x if down else h.float() < x
    return torch.where(wrong, torch.nextafter(h, towards), h)


def upper_bound(queries: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The largest logit (before scaling) that any key in each box can give each query.

    queries: float32 ``[layers, n, heads, head_dim]`` rotated back to position 0; lo, hi: ``[chunks, layers,
    kv_heads, head_dim]`` (heads a multiple of kv_heads: grouped-query attention) -> ``[chunks, layers, n,
    heads]``.
    """
    group = queries.shape[2] // lo.shape[2]
    lo = lo.float().repeat_interleave(group, dim=2)  # [B, L, H, D]
    hi = hi.float().repeat_interleave(group, dim=2)
    # max(q lo, q hi) = q+ hi + q- lo per dimension (lo <= hi): two matrix products, no [B, L, n, H, D]
    positive, negative = queries.clamp(min=0), queries.clamp(max=0)
    return torch.einsum("lnhd,blhd->blnh", positive, hi) + torch.einsum("lnhd,blhd->blnh", negative, lo)


def head_shares(queries: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """How a message's queries would split their attention between candidate chunks, per layer and head.

    For every layer, query token and head, the candidates' bounds (scaled by ``1 / sqrt(head_dim)``) go
    through a softmax over the candidates; a chunk's share is then its largest over the query tokens (one
    word of the message that looks for it is enough).

    queries: float32 ``[layers, n, heads, head_dim]`` rotated back to position 0; lo, hi: ``[chunks,
    layers, kv_heads, head_dim]`` -> float32 ``[chunks, layers, heads]`` in [0, 1].
    """
    bound = upper_bound(queries, lo, hi) / queries.shape[-1] ** 0.5  # [B, L, n, H]
    return torch.softmax(bound, dim=0).amax(dim=2)


def attention_shares(
    queries: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, heads: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`head_shares` averaged over the layers and heads, or over the ``heads`` chosen (bool
    ``[layers, heads]``, at least one true: retrieval heads, :mod:`kvos.cli.calibrate_retrieval`) -> float32
    ``[chunks]`` in [0, 1]."""
    shares = head_shares(queries, lo, hi)
    return shares.mean(dim=(1, 2)) if heads is None else shares[:, heads].mean(dim=1)


def head_mask(heads: Sequence[tuple[int, int]], layers: Sequence[int], num_heads: int) -> torch.Tensor:
    """(layer, query head) pairs as a bool ``[len(layers), num_heads]`` mask over queries tapped at
    ``layers``, for :func:`attention_shares`; ConfigError for a pair outside them."""
    mask = torch.zeros(len(layers), num_heads, dtype=torch.bool)
    for layer, head in heads:
        if layer not in layers or not 0 <= head < num_heads:
            raise ConfigError(
                f"retrieval head ({layer}, {head}) is not in the digested layers {tuple(layers)} x "
                f"[0, {num_heads}) heads"
            )
        mask[list(layers).index(layer), head] = True
    return mask


def load_retrieval_heads(path: str | Path) -> tuple[tuple[int, int], ...]:
    """The ``retrieval_heads`` of a ``kvos calibrate --retrieval`` JSON file, as SessionConfig takes them."""
    try:
        heads = json.loads(Path(path).read_text())["retrieval_heads"]
        pairs = tuple((int(layer), int(head)) for layer, head in heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a retrieval-heads calibration ({exc})") from exc
    if not pairs:
        raise ConfigError(f"{path}: retrieval_heads is empty")
    return pairs
