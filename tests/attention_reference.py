"""Attention in float64 over the keys each query sees by position: what the attention paths are held to."""

from __future__ import annotations

import math

import torch


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """q [n, H, D], k/v [T, Hkv, D] -> [n, H*D], float64, masking by positions."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    for h in range(heads):
        scores = q[:, h].double() @ k[:, h // group].double().T / math.sqrt(dim)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[:, h // group].double()
    return out.reshape(n, heads * dim)
