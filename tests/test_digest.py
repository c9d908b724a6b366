"""Key digests: the stored box bounds every key's logit for any query (Quest's bound, kept through RoPE and
float16 storage), the attention shares find a planted chunk, and the query tap hands back queries rotated
back to position 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvos.engine.engine import Engine
from kvos.model.loader import load_model
from kvos.model.rope import LayerRopes, Rope
from kvos.policy.digest import attention_shares, digest_keys, unrotate, upper_bound


def rotated_keys(n: int, layers: int, kv_heads: int, dim: int, rope: Rope, seed: int) -> tuple:
    """Random keys [layers, n, kv_heads, dim] rotated at random positions, and their content (unrotated)."""
    g = torch.Generator().manual_seed(seed)
    content = torch.randn(layers, n, kv_heads, dim, generator=g) * torch.rand(1, 1, 1, dim, generator=g) * 4
    start = int(torch.randint(0, 5000, (1,), generator=g))
    positions = torch.arange(start, start + n)
    cos, sin = rope.cos_sin(positions, torch.float32, torch.device("cpu"))
    keys = torch.stack([Rope.apply(content[i], cos, sin) for i in range(layers)])
    return keys, positions, content


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_is_never_below_any_keys_logit(dtype: torch.dtype) -> None:
    rope = Rope(64, 10000.0)
    for seed in range(20):
        keys, positions, _ = rotated_keys(37, 3, 2, 64, rope, seed)
        keys = keys.to(dtype)
        digest = digest_keys(keys, positions, LayerRopes([rope] * keys.shape[0]), [0, 2])
        assert digest.lo.dtype == torch.float16 and digest.lo.shape == (2, 2, 64)
        # the true content of the stored keys (rotated back in float32 from what the pool holds)
        content = torch.stack([unrotate(keys[i], positions, rope) for i in (0, 2)])  # [2, n, kv, D]
        queries = torch.randn(2, 9, 4, 64, generator=torch.Generator().manual_seed(100 + seed)) * 3
        bound = upper_bound(queries, digest.lo[None], digest.hi[None])[0]  # [2, 9, 4]
        kv = content.repeat_interleave(2, dim=2)  # heads 0,1 read kv head 0; heads 2,3 kv head 1
        logits = torch.einsum("lqhd,lkhd->lqhk", queries, kv)  # [2, 9, 4, n]
        assert (logits.amax(-1) <= bound + 1e-4 * bound.abs().clamp(min=1)).all()


def test_a_one_token_chunk_is_bounded_exactly() -> None:
    """A box around one key is that key (to float16 rounding): the bound is its logit."""
    rope = Rope(64, 10000.0)
    keys, positions, content = rotated_keys(1, 1, 1, 64, rope, 3)
    digest = digest_keys(keys, positions, LayerRopes([rope] * keys.shape[0]), [0])
    queries = torch.randn(1, 5, 2, 64, generator=torch.Generator().manual_seed(4))
    bound = upper_bound(queries, digest.lo[None], digest.hi[None])[0]
    logits = torch.einsum("lqhd,ld->lqh", queries, content[:, 0, 0])
    assert torch.allclose(bound, logits, rtol=2e-3, atol=2e-2)


def test_content_is_the_same_wherever_a_chunk_sits() -> None:
    """The digest does not depend on where the chunk sat: the same keys rotated at other positions give
    the same box (to float16 rounding)."""
    rope = Rope(32, 10000.0)
    keys, positions, content = rotated_keys(16, 2, 2, 32, rope, 7)
    moved = torch.stack([rope.reanchor(keys[i], positions, positions + 3000) for i in range(2)])
    a = digest_keys(keys, positions, LayerRopes([rope] * keys.shape[0]), [0, 1])
    b = digest_keys(moved, positions + 3000, LayerRopes([rope] * moved.shape[0]), [0, 1])
    for box in (a, b):  # rounded outwards: the box holds every key
        assert (box.lo.float() <= content.amin(1) + 1e-5).all() and (
            box.hi.float() >= content.amax(1) - 1e-5
        ).all()
        assert torch.allclose(box.lo.float(), content.amin(1), rtol=2e-3, atol=1e-3)
        assert torch.allclose(box.hi.float(), content.amax(1), rtol=2e-3, atol=1e-3)


def test_the_shares_find_a_planted_chunk() -> None:
    """Twenty chunks of unrelated keys and one that holds a key along the query's direction: the planted
    chunk gets the largest share, with a clear margin."""
    g = torch.Generator().manual_seed(0)
    dim, heads = 32, 2
    query = torch.randn(1, 3, heads, dim, generator=g)
    chunks = [torch.randn(1, 12, 1, dim, generator=g) for _ in range(20)]
    planted = 13
    chunks[planted][0, 5, 0] = 3 * query[0, 1, 0] / query[0, 1, 0].norm() * dim**0.5
    lo = torch.stack([c.amin(1) for c in chunks])  # [B, 1, 1, D]
    hi = torch.stack([c.amax(1) for c in chunks])
    shares = attention_shares(query, lo, hi)
    assert int(shares.argmax()) == planted
    assert shares[planted] > 2 * shares[torch.arange(20) != planted].max()
    assert ((shares >= 0) & (shares <= 1)).all()


def test_digest_bytes_against_the_saved_bytes() -> None:
    rope = Rope(64, 10000.0)
    keys, positions, _ = rotated_keys(128, 4, 2, 64, rope, 1)
    digest = digest_keys(keys, positions, LayerRopes([rope] * keys.shape[0]), range(4))
    saved = 2 * keys.numel() * keys.element_size()  # K and V in float32
    assert digest.nbytes == 2 * 4 * 2 * 64 * 2
    assert digest.nbytes / saved < 0.005


def test_tapped_queries_come_back_rotated_to_position_zero(model_dir: Path) -> None:
    """Layer 0's queries depend only on the tokens: prefilled at two different positions, the tapped
    queries rotated back agree; a later layer's differ only through the different context."""
    engine = Engine(load_model(model_dir), block_size=8)
    rope = engine.model.ropes[0]
    tokens = [5, 17, 33, 64, 65, 66, 90, 12, 3]
    out = []
    for start in (0, 700):
        seq = engine.new_sequence()
        taps: dict[int, torch.Tensor] = {}
        positions = torch.arange(start, start + len(tokens))
        engine.extend(seq, tokens, positions.tolist(), query_layers=frozenset({0}), queries=taps)
        assert taps[0].shape == (len(tokens), 4, 16)
        out.append(unrotate(taps[0], positions, rope))
        engine.release(seq)
    assert torch.allclose(out[0], out[1], atol=1e-5)
