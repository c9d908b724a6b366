"""stories260K (llama2.c format, from ../shared) through kvos vs an independent reference forward pass.

The reference below reads the .bin itself and follows llama2.c's run.c: numpy, no kvos code, interleaved
RoPE pairs with no weight permutation, a plain contiguous KV cache.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvos.engine.engine import Engine
from kvos.model.loader import load_model

STEPS = 80


class RunC:
    """A deliberately plain re-implementation of llama2.c's forward pass (float64 for a tight reference)."""

    def __init__(self, path: Path) -> None:
        raw = path.read_bytes()
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", raw)
        self.dim, self.layers, self.heads, self.kv_heads = dim, layers, heads, kv_heads
        self.hd = dim // heads
        f = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
        kv_dim = kv_heads * self.hd
        shapes = [
            ("emb", (abs(vocab), dim)),
            ("rms_att", (layers, dim)),
            ("wq", (layers, dim, dim)),
            ("wk", (layers, kv_dim, dim)),
            ("wv", (layers, kv_dim, dim)),
            ("wo", (layers, dim, dim)),
            ("rms_ffn", (layers, dim)),
            ("w1", (layers, hidden, dim)),
            ("w2", (layers, dim, hidden)),
            ("w3", (layers, hidden, dim)),
            ("rms_final", (dim,)),
        ]
        off = 0
        for name, shape in shapes:
            n = int(np.prod(shape))
            setattr(self, name, f[off : off + n].reshape(shape))
            off += n
        self.kcache = np.zeros((layers, seq_len, kv_dim))
        self.vcache = np.zeros((layers, seq_len, kv_dim))

    @staticmethod
    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * (x / np.sqrt(np.mean(x * x) + 1e-5))

    def rope(self, v: np.ndarray, pos: int) -> np.ndarray:
        out = v.copy()
        for i in range(0, v.shape[0], 2):
            freq = 1.0 / 10000.0 ** ((i % self.hd) / self.hd)
            c, s = np.cos(pos * freq), np.sin(pos * freq)
            out[i], out[i + 1] = v[i] * c - v[i + 1] * s, v[i] * s + v[i + 1] * c
        return out

    def forward(self, token: int, pos: int) -> np.ndarray:
        x = self.emb[token].copy()
        group = self.heads // self.kv_heads
        for layer in range(self.layers):
            h = self.rms(x, self.rms_att[layer])
            q = self.rope(self.wq[layer] @ h, pos)
            self.kcache[layer, pos] = self.rope(self.wk[layer] @ h, pos)
            self.vcache[layer, pos] = self.wv[layer] @ h
            att_out = np.zeros(self.dim)
            for head in range(self.heads):
                kvh = head // group
                qh = q[head * self.hd : (head + 1) * self.hd]
                keys = self.kcache[layer, : pos + 1, kvh * self.hd : (kvh + 1) * self.hd]
                vals = self.vcache[layer, : pos + 1, kvh * self.hd : (kvh + 1) * self.hd]
                scores = keys @ qh / np.sqrt(self.hd)
                p = np.exp(scores - scores.max())
                att_out[head * self.hd : (head + 1) * self.hd] = (p / p.sum()) @ vals
            x = x + self.wo[layer] @ att_out
            h = self.rms(x, self.rms_ffn[layer])
            a = self.w1[layer] @ h
            x = x + self.w2[layer] @ ((a / (1 + np.exp(-a))) * (self.w3[layer] @ h))
        return self.emb @ self.rms(x, self.rms_final)


@pytest.fixture(scope="module")
def stories(shared_dir: Path) -> Path:
    path = shared_dir / "models" / "stories260K" / "stories260K.bin"
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def test_greedy_tokens_and_logits_match_reference(stories: Path) -> None:
    ref = RunC(stories)
    engine = Engine(load_model(stories), block_size=16)
    seq = engine.new_sequence()
    token, ours, theirs = 1, [], []
    logits = engine.extend(seq, [token])[0]
    for pos in range(STEPS):
        expected = ref.forward(token, pos)
        assert np.abs(logits.numpy() - expected).max() <= 1e-4
        theirs.append(int(np.argmax(expected)))
        token = int(torch.argmax(logits))
        ours.append(token)
        logits = engine.decode(seq, token)
    assert ours == theirs
    assert len(set(ours)) > 10, "a real model's story uses more than a handful of tokens"


def test_config_read_from_header(stories: Path) -> None:
    c = load_model(stories).config
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        64,
        172,
        5,
        8,
        4,
        512,
    )
    assert c.max_position_embeddings == 512 and c.tie_word_embeddings
