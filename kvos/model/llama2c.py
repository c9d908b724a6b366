"""llama2.c legacy (version 0) ``.bin`` checkpoints.

Layout: seven little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a
negative vocab_size means an untied classifier at the end), then float32 arrays in a fixed order, then two
RoPE tables that we skip. llama2.c rotates interleaved pairs (2i, 2i+1); Hugging Face-style models rotate
halves, so the rows of wq and wk are permuted on load and the rest of kvos sees an ordinary Llama.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from kvos.errors import ModelLoadError
from kvos.model.config import ModelConfig
from kvos.model.dtype import resolve_dtype
from kvos.model.transformer import Transformer

HEADER = struct.Struct("<7i")


def read_llama2c(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Parse a checkpoint into a config and float32 tensors under Hugging Face Llama names."""
    raw = Path(path).read_bytes()
    if len(raw) < HEADER.size:
        raise ModelLoadError(f"{path} is too short to be a llama2.c checkpoint")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = HEADER.unpack_from(raw)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, layers, heads, kv_heads, vocab, seq_len) <= 0 or dim % heads:
        raise ModelLoadError(f"{path} has an invalid llama2.c header")
    head_dim = dim // heads
    kv_dim = kv_heads * head_dim
    floats = np.frombuffer(raw, dtype="<f4", offset=HEADER.size)
    reader = _Reader(floats, str(path))
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": reader.take(vocab, dim)}
    per_layer = {
        "input_layernorm.weight": (dim,),
        "self_attn.q_proj.weight": (dim, dim),
        "self_attn.k_proj.weight": (kv_dim, dim),
        "self_attn.v_proj.weight": (kv_dim, dim),
        "self_attn.o_proj.weight": (dim, dim),
        "post_attention_layernorm.weight": (dim,),
        "mlp.gate_proj.weight": (hidden, dim),
        "mlp.down_proj.weight": (dim, hidden),
        "mlp.up_proj.weight": (hidden, dim),
    }
    for name, shape in per_layer.items():
        stacked = reader.take(layers, *shape)
        for i in range(layers):
            w[f"model.layers.{i}.{name}"] = stacked[i]
    w["model.norm.weight"] = reader.take(dim)
    reader.skip(seq_len * head_dim)  # freq_cis_real and freq_cis_imag, each seq_len x head_dim / 2
    w["lm_head.weight"] = w["model.embed_tokens.weight"] if shared else reader.take(vocab, dim)
    for i in range(layers):
        q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
        w[q] = interleaved_to_halves(w[q], heads)
        w[k] = interleaved_to_halves(w[k], kv_heads)
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=seq_len,
        tie_word_embeddings=shared,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    return config, w


def interleaved_to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Permute the rows of a [heads * head_dim, dim] projection so that rotating halves equals
    llama2.c's rotation of interleaved pairs: within each head, even rows first, then odd rows."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_llama2c(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a llama2.c checkpoint as a :class:`Transformer`."""
    config, weights = read_llama2c(path)
    torch_dtype = resolve_dtype(dtype)
    moved = {k: v.to(device=torch.device(device), dtype=torch_dtype) for k, v in weights.items()}
    return Transformer(config, moved)


class _Reader:
    """Sequential reader of float32 arrays from a flat buffer."""

    def __init__(self, floats: np.ndarray, name: str) -> None:
        self.floats, self.name, self.offset = floats, name, 0

    def take(self, *shape: int) -> torch.Tensor:
        count = int(np.prod(shape))
        self.skip(count)
        out = torch.empty(count)  # torch's allocation starts on a cache line (numpy's, 16 bytes past one)
        out.numpy()[:] = self.floats[self.offset - count : self.offset]
        return out.reshape(shape)

    def skip(self, count: int) -> None:
        if self.offset + count > self.floats.shape[0]:
            raise ModelLoadError(
                f"{self.name} ends early: the header promises more weights than the file holds"
            )
        self.offset += count
