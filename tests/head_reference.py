"""An independent reference for per-head key masks: the model's forward pass written out head by head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvos.model.rope import Rope
from kvos.model.transformer import Transformer, rms_norm


def masked_reference(model: Transformer, ids: list[int], mask: torch.Tensor) -> torch.Tensor:
    """An independent full-sequence forward pass with a per-(layer, KV head) key mask.

    mask: bool [L, Hkv, n, n], True where query i may see key j (on top of causality). Written out
    head by head, without kvos's attention code. Returns float32 logits [n, vocab].
    """
    c, n = model.config, len(ids)
    group, d = c.group_size, c.head_dim
    x = F.embedding(torch.tensor(ids), model.embed)
    cos, sin = model.ropes[0].cos_sin(torch.arange(n), model.dtype, model.device)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i, layer in enumerate(model.layers):
        qkv = F.linear(rms_norm(x, layer.attn_norm, c.rms_norm_eps), layer.qkv).view(n, -1, d)
        q = Rope.apply(qkv[:, : c.num_heads], cos, sin)
        k = Rope.apply(qkv[:, c.num_heads : c.num_heads + c.num_kv_heads], cos, sin)
        v = qkv[:, c.num_heads + c.num_kv_heads :]
        heads = []
        for h in range(c.num_heads):
            scores = q[:, h] @ k[:, h // group].T / math.sqrt(d)
            scores = scores.masked_fill(~(causal & mask[i, h // group]), float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[:, h // group])
        x = x + F.linear(torch.cat(heads, dim=1), layer.o)
        gate, up = F.linear(rms_norm(x, layer.mlp_norm, c.rms_norm_eps), layer.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down)
    return model.head(rms_norm(x, model.final_norm, c.rms_norm_eps))
