"""RoPE: re-anchoring stored keys by a delta equals rotating them at the new position."""

from __future__ import annotations

import pytest
import torch

from kvos.model.rope import Rope

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("delta", [-37, 5, 900])
def test_shift_equals_rotation_at_new_position(scaling: dict | None, delta: int) -> None:
    rope = Rope(64, 10000.0, scaling)
    k = torch.randn(20, 2, 64, dtype=torch.float64).float()
    pos = torch.arange(100, 120)
    cos, sin = rope.cos_sin(pos, torch.float32, k.device)
    stored = Rope.apply(k, cos, sin)
    cos2, sin2 = rope.cos_sin(pos + delta, torch.float32, k.device)
    expected = Rope.apply(k, cos2, sin2)
    assert (rope.shift(stored, delta) - expected).abs().max().item() < 1e-4
    per_token = torch.full((20,), delta)
    assert torch.equal(rope.shift(stored, per_token), rope.shift(stored, delta))


def test_shift_zero_is_identity_and_inverse() -> None:
    rope = Rope(32, 500000.0)
    k = torch.randn(7, 1, 32)
    assert torch.allclose(rope.shift(k, 0), k)
    assert torch.allclose(rope.shift(rope.shift(k, 123), -123), k, atol=1e-5)


def test_rope_matches_transformers_inverse_frequencies() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[2]
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=2, rope_parameters={"rope_theta": 10000.0, **scaling}
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(Rope(64, 10000.0, scaling).inv_freq, expected, rtol=1e-6)
