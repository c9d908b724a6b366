"""Paged attention through the pool equals plain contiguous attention."""

from __future__ import annotations

import math

import torch
from attention_reference import reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos.memory.page_table import PageTable
from kvos.memory.pool import KVLayout, KVPool
from kvos.model.attention import AttentionMetadata, paged_attention


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.integers(1, 9),
    cached=st.integers(0, 30),
    new=st.integers(1, 12),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    window=st.sampled_from([None, 5]),
    gap=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_contiguous(
    block_size: int, cached: int, new: int, kv_heads: int, group: int, window: int | None, gap: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    dim, total = 8, cached + new
    pool = KVPool(KVLayout(1, kv_heads, dim, block_size))
    table, noise = PageTable(block_size, pool), PageTable(block_size, pool)
    for i in range(total):  # interleave another table so this one's block ids are not contiguous
        table.append(1)
        if i % block_size == 0:
            noise.append(block_size)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)
    q = torch.randn(new, kv_heads * group, dim, generator=g)
    pos = torch.arange(total) * (1 + gap)  # sparse positions when gap > 0
    slots = torch.tensor(table.slots(0, total))
    pool.write(0, slots, k, v)
    meta = AttentionMetadata(
        positions=pos[cached:], write_slots=slots[cached:], read_slots=slots, key_positions=pos
    )
    keys, values = pool.gather(0, slots)
    got = paged_attention(q, keys, values, meta, window, 0)
    expected = reference(q, k, v, pos[cached:], pos, window)
    assert torch.allclose(got.double(), expected, atol=1e-5)


def test_decode_capture_records_probabilities() -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 2, 4, generator=g), torch.randn(10, 2, 4, generator=g)
    q = torch.randn(1, 4, 4, generator=g)
    pos = torch.arange(10)
    meta = AttentionMetadata(
        positions=pos[-1:],
        write_slots=pos[-1:],
        read_slots=pos,
        key_positions=pos,
        capture_layers=frozenset({3}),
    )
    paged_attention(q, k, v, meta, None, 3)
    probs = meta.captured[3]
    assert probs.shape == (4, 10)
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    expected = torch.softmax(q[0, 0] @ k[:, 0].T / 2.0, -1)
    assert torch.allclose(probs[0], expected, atol=1e-6)


def test_prefill_capture_is_the_mean_over_the_observation_window() -> None:
    g = torch.Generator().manual_seed(1)
    n, total = 6, 15
    k, v = torch.randn(total, 2, 8, generator=g), torch.randn(total, 2, 8, generator=g)
    q = torch.randn(n, 4, 8, generator=g)
    pos = torch.arange(total)
    meta = AttentionMetadata(
        positions=pos[-n:],
        write_slots=pos[-n:],
        read_slots=pos,
        key_positions=pos,
        capture_layers=frozenset({0}),
        capture_window=4,
    )
    paged_attention(q, k, v, meta, None, 0)
    expected = torch.zeros(4, total, dtype=torch.float64)
    for h in range(4):
        for i in range(n - 4, n):
            scores = q[i, h].double() @ k[:, h // 2].double().T / math.sqrt(8)
            scores[pos > pos[-n:][i]] = float("-inf")
            expected[h] += torch.softmax(scores, -1) / 4
    assert torch.allclose(meta.captured[0].double(), expected, atol=1e-6)
