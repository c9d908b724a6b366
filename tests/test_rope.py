"""RoPE: re-anchoring stored keys equals rotating them at the new position."""

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


def rotated(rope: Rope, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = rope.cos_sin(pos, k.dtype, k.device)
    return Rope.apply(k, cos, sin)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("delta", [-37, 5, 900, 30000])
def test_shift_equals_rotation_at_new_position(scaling: dict | None, delta: int) -> None:
    rope = Rope(64, 10000.0, scaling)
    k = torch.randn(20, 2, 64, generator=torch.Generator().manual_seed(delta % 1000))
    pos = torch.arange(100, 120) * 7
    moved = rope.shift(rotated(rope, k, pos), delta, pos)
    assert (moved - rotated(rope, k, pos + delta)).abs().max().item() < 5e-6


def test_reanchor_per_token_targets_and_inverse() -> None:
    rope = Rope(32, 500000.0)
    k = torch.randn(7, 1, 32, generator=torch.Generator().manual_seed(0))
    old = torch.tensor([0, 1, 2, 3, 50, 51, 52])
    new = torch.tensor([10, 11, 12, 13, 4, 5, 6])
    stored = rotated(rope, k, old)
    assert (rope.reanchor(stored, old, new) - rotated(rope, k, new)).abs().max().item() < 5e-6
    assert torch.allclose(rope.reanchor(rope.reanchor(stored, old, new), new, old), stored, atol=5e-6)
    assert torch.equal(rope.reanchor(stored, old, old), stored)


def test_rope_matches_transformers_inverse_frequencies() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[2]
    assert scaling is not None
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=2, rope_parameters={"rope_theta": 10000.0, **scaling}
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(Rope(64, 10000.0, scaling).inv_freq, expected, rtol=1e-6)


def test_half_rotation_from_cached_tables_equals_the_direct_angle_difference() -> None:
    """Restores take cos/sin of (new - old) from cached float64 tables of the float32 angles; the result is
    the direct float64 cos/sin of the difference to float32 rounding, and positions outside the tables
    (negative ones, here) take the direct path."""
    rope = Rope(64, 10000.0)
    cpu = torch.device("cpu")
    old = torch.arange(0, 3000, 7)
    new = old.flip(0) + 11
    cos, sin = rope.half_rotation(old, new, cpu)
    assert rope.angle_tables(old, new, cpu) is not None
    delta = rope.angles(new, cpu).double() - rope.angles(old, cpu).double()
    assert (cos - delta.cos().float()).abs().max().item() <= 2e-7
    assert (sin - delta.sin().float()).abs().max().item() <= 2e-7
    assert rope.angle_tables(old - 5000, new, cpu) is None
    cos_neg, sin_neg = rope.half_rotation(old - 5000, new, cpu)
    delta = rope.angles(new, cpu).double() - rope.angles(old - 5000, cpu).double()
    assert torch.equal(cos_neg, delta.cos().float()) and torch.equal(sin_neg, delta.sin().float())
    full_cos, signed_sin = rope.rotation(old, new, cpu)
    assert torch.equal(full_cos[:, 0], torch.cat((cos, cos), -1))
    assert torch.equal(signed_sin[:, 0], torch.cat((-sin, sin), -1))
