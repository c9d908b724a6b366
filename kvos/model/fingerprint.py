"""A model's fingerprint: a short digest that tells one model (weights, dtype, tokenizer) from another.

Saved K/V are only valid for the model that computed them. A fingerprint hashes the model's config, its
dtype, each weight's shape and a sample of its bytes (the first and last 4 KiB of every tensor: a retrained
or re-quantized model changes them, and no tensor is read whole, so it stays fast for large models), and the
tokenizer's vocabulary size, chat template and the ids of a probe text.

Sessions saved under one fingerprint are only restored under the same one, so a change to what it hashes
retires every saved session of the models it affects (they stay on disk under their old key, unused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from kvos.model.linear import RowStack
from kvos.model.tokenizer import Tokenizer
from kvos.model.transformer import Transformer

SAMPLE_BYTES = 4096
_PROBE = "kvos fingerprint: Hello, world! 0123456789 <|im_start|>user\n"


def _tensors(weight: object) -> list[torch.Tensor]:
    """The tensors of a weight: itself, the tensor fields of a quantized weight, or those of each part of a
    stack of differently typed projections (a fused QKV of Q5_0 q/k and a Q8_0 v), in order."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    if isinstance(weight, RowStack):
        return [t for part in weight.parts for t in _tensors(part)]
    if dataclasses.is_dataclass(weight):
        values = (getattr(weight, f.name) for f in dataclasses.fields(weight))
        return [t for t in values if isinstance(t, torch.Tensor)]
    return []


def _sample(t: torch.Tensor) -> bytes:
    """Shape, dtype and the first and last :data:`SAMPLE_BYTES` bytes of ``t``."""
    flat = t.detach().reshape(-1)
    per = max(1, SAMPLE_BYTES // max(t.element_size(), 1))
    ends = flat[:per] if flat.numel() <= 2 * per else torch.cat([flat[:per], flat[-per:]])
    raw = ends.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return f"{tuple(t.shape)}{t.dtype}".encode() + raw


def _weights(model: Transformer) -> list[object]:
    weights: list[object] = [model.embed, model.final_norm, model.lm_head]
    for layer in model.layers:
        weights += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
    return weights


def model_fingerprint(model: Transformer, tokenizer: Tokenizer) -> str:
    """32 hex digits that change when the model's config, dtype, weights or tokenizer change."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    for weight in _weights(model):
        for t in _tensors(weight):
            h.update(_sample(t))
    h.update(str(tokenizer.vocab_size).encode())
    h.update((tokenizer.chat_template or "").encode())
    h.update(json.dumps(tokenizer.encode(_PROBE)).encode())
    return h.hexdigest()
