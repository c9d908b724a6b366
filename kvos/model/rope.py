"""Rotary position embedding (half-rotation convention, as Hugging Face Llama/Qwen/Mistral).

Keys are stored after RoPE. Because rotations compose, R(p + d) = R(d) R(p), a stored key can be moved to
another position by rotating it by the delta alone: :meth:`Rope.shift` is how kvos re-anchors saved blocks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvos.errors import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies, float32 [head_dim // 2], with optional linear or Llama-3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)  # type: ignore[arg-type]
    else:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, keep high ones, blend in between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """Cos/sin tables computed on demand for arbitrary (possibly sparse) integer positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [n] (may be negative, for deltas) -> cos, sin each [n, head_dim] in ``dtype``.

        Angles are computed in float32 from the integer positions, as the reference implementations do.
        """
        inv = self.inv_freq.to(device)
        angles = positions.to(device=device, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, head_dim]; cos/sin: [n, head_dim] -> rotated x, same shape."""
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]

    def shift(self, keys: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
        """Re-anchor stored keys by a position delta.

        keys: [n, kv_heads, head_dim] already rotated for positions p; delta: int or int64 [n].
        Returns keys rotated for positions p + delta (computed in float32, cast back to keys' dtype).
        """
        n = keys.shape[0]
        d = torch.full((n,), int(delta), dtype=torch.int64) if isinstance(delta, int) else delta
        cos, sin = self.cos_sin(d, torch.float32, keys.device)
        return self.apply(keys.float(), cos, sin).to(keys.dtype)
