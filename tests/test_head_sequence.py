"""HeadSequence and run_budgeted: sequences of the engine whose heads hold their own tokens, in the engine's
own pool; they free memory and compute what the model would with those keys masked out per head; with a budget
that keeps everything, exactly the full-cache Engine's logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from head_reference import masked_reference

from kvos.engine.engine import Engine
from kvos.engine.head_sequence import HeadSequence
from kvos.model.loader import load_model
from kvos.model.transformer import Transformer
from kvos.policy.budgeted import run_budgeted
from kvos.policy.entropy import head_budgets
from kvos.policy.token_select import POLICIES

N = 60
PREFILL = 20


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Transformer:
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return torch.randint(0, 300, (N,), generator=torch.Generator().manual_seed(1)).tolist()


def engine_logits(model: Transformer, ids: list[int], prefill: int) -> torch.Tensor:
    """Full-cache Engine: prefill, then one token at a time -> float32 [len(ids), vocab]."""
    engine = Engine(model)
    seq = engine.new_sequence()
    out = [engine.extend(seq, ids[:prefill], logits="all")]
    out += [engine.decode(seq, t)[None] for t in ids[prefill:]]
    return torch.cat(out)


def test_reference_without_mask_is_the_engine(model: Transformer, tokens: list[int]) -> None:
    c = model.config
    everything = torch.ones(c.num_layers, c.num_kv_heads, N, N, dtype=torch.bool)
    ref = masked_reference(model, tokens, everything)
    assert (ref - engine_logits(model, tokens, PREFILL)).abs().max() <= 1e-4


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_full_budget_equals_the_engine(model: Transformer, tokens: list[int], policy: str) -> None:
    c = model.config
    calibration = {(layer, h): 1.0 + layer + 2 * h for layer in range(c.num_layers) for h in range(2)}
    run = run_budgeted(model, tokens, policy, N, calibration=calibration, prefill=PREFILL)
    assert run.logits.shape == (N - 1, c.vocab_size) and run.logits.dtype == torch.float32
    assert (run.logits - engine_logits(model, tokens, PREFILL)[:-1]).abs().max() <= 1e-4
    assert run.resident_bytes == run.uniform_bytes > 0 and run.seconds > 0


def test_dropped_keys_are_masked_per_head_and_freed(model: Transformer, tokens: list[int]) -> None:
    """Heads drop different tokens after the prefill; decoding on gives the masked reference's logits."""
    c = model.config
    cache = HeadSequence(Engine(model, block_size=4))
    out = [cache.extend(tokens[:PREFILL])]
    drops = {(0, 0): [3, 4, 5, 6, 7, 8, 9, 10, 11], (1, 1): [0, 2, 17], (1, 0): list(range(1, 19))}
    used = cache.store.num_used
    untouched = {(0, 1): cache.store.gather(0, cache._slots[0, :, :PREFILL])}
    for (layer, h), gone in drops.items():
        keep = [t for t in range(PREFILL) if t not in gone]
        freed = cache.drop(layer, h, keep)
        assert freed == 5 - math.ceil(len(keep) / 4)  # 20 tokens in 5 blocks of 4 -> ceil(kept / 4)
        assert torch.equal(cache.positions(layer, h), torch.tensor(keep))
    assert cache.store.num_used == used - (2 + 0 + 4)
    after = cache.store.gather(0, cache._slots[0, :, :PREFILL])
    assert all(torch.equal(a[1], b[1]) for a, b in zip(after, untouched[0, 1], strict=True))
    out += [cache.extend([t]) for t in tokens[PREFILL:]]
    mask = torch.ones(c.num_layers, c.num_kv_heads, N, N, dtype=torch.bool)
    for (layer, h), gone in drops.items():
        mask[layer, h, PREFILL:, gone] = False
    ref = masked_reference(model, tokens, mask)
    assert (torch.cat(out) - ref).abs().max() <= 1e-4


def test_budget_is_held_and_memory_is_freed(model: Transformer, tokens: list[int]) -> None:
    full = run_budgeted(model, tokens, "uniform", N, block_size=4)
    small = run_budgeted(model, tokens, "h2o", 12, block_size=4)
    assert small.resident_bytes < 0.5 * full.resident_bytes
    assert (small.logits - full.logits).abs().max() > 1e-3  # dropping keys changes the output
    cache = HeadSequence(Engine(model, block_size=4))
    policy = POLICIES["h2o"]()
    for t in tokens[:30]:
        cache.extend([t])
        cache.enforce(policy, policy.budgets(cache.next_position, 12, cache.rows))
        assert all(cache.num_tokens(*row) == min(12, cache.next_position) for row in cache.rows)
    rows = len(cache.rows)
    assert cache.store.num_used == rows * 3  # 12 tokens per head in blocks of 4
    assert cache.resident_bytes == rows * 3 * cache.store.bytes_per_block


def test_entropy_rows_hold_their_head_budgets(model: Transformer, tokens: list[int]) -> None:
    calibration = {(0, 0): 0.5, (0, 1): 4.0, (1, 0): 1.0, (1, 1): 2.5}
    policy = POLICIES["entropy"](calibration=calibration)
    cache = HeadSequence(Engine(model, block_size=4))
    cache.extend(tokens[:40])
    cache.enforce(policy, policy.budgets(40, 10, cache.rows))
    expected = head_budgets(calibration, 40, 10 / 40)  # mean H 2.0: ratios 0.3, 2.0, 0.5, 1.25
    assert expected == {(0, 0): 3, (0, 1): 20, (1, 0): 5, (1, 1): 13}
    assert {row: cache.num_tokens(*row) for row in cache.rows} == expected
    assert cache.store.num_used == 1 + 5 + 2 + 4  # ceil(budget / 4) head-blocks per row
    assert cache.uniform_bytes() == 4 * 3 * cache.store.bytes_per_block  # 41 tokens: 11 per row


def test_stories260k_full_budget_equals_the_engine(shared_dir: Path) -> None:
    """A real pretrained model (llama2.c format, 8 query heads over 4 KV heads): same logits as the Engine."""
    path = shared_dir / "models" / "stories260K" / "stories260K.bin"
    if not path.exists():
        pytest.skip(f"{path} not present")
    stories = load_model(path)
    ids = [1, *torch.randint(3, 512, (95,), generator=torch.Generator().manual_seed(2)).tolist()]
    run = run_budgeted(stories, ids, "snapkv", 96, prefill=40)
    assert (run.logits - engine_logits(stories, ids, 40)[:-1]).abs().max() <= 1e-4


def test_per_head_and_whole_sequences_share_one_pool(model: Transformer, tokens: list[int]) -> None:
    """A per-head sequence beside an ordinary one in the same engine: both read back what they wrote (the
    ordinary one's logits are those of an engine of its own), the pool counts both, and a per-head
    sequence's released head-blocks are taken by the next one without growing the pool."""
    engine = Engine(model, block_size=4)
    heads = HeadSequence(engine)
    seq = engine.new_sequence()
    heads.extend(tokens[:PREFILL])
    whole = engine.extend(seq, tokens[:PREFILL], logits="all")
    out = [heads.extend([t]) for t in tokens[PREFILL:30]]
    whole_steps = [engine.decode(seq, t)[None] for t in tokens[PREFILL:30]]
    assert torch.equal(whole, engine_logits(model, tokens[:PREFILL], PREFILL))
    reference = engine_logits(model, tokens[:30], PREFILL)
    assert (torch.cat(out) - reference[PREFILL:]).abs().max() <= 1e-4
    assert (torch.cat(whole_steps) - reference[PREFILL:]).abs().max() <= 1e-4
    c = model.config
    rows = c.num_layers * c.num_kv_heads
    assert heads.resident_bytes == rows * math.ceil(30 / 4) * heads.store.bytes_per_block
    assert engine.pool.head_live_bytes == heads.resident_bytes
    whole_bytes = seq.num_blocks * engine.pool.layout.bytes_per_block
    assert engine.pool.live_bytes == whole_bytes + heads.resident_bytes
    capacity = heads.store.pool.num_blocks
    heads.release()
    assert engine.pool.head_live_bytes == 0
    again = HeadSequence(engine)
    again.extend(tokens[:8])  # fits in what the first one gave back: the store does not grow
    assert heads.store.pool.num_blocks == capacity
    assert engine.pool.head_live_bytes == again.resident_bytes == rows * 2 * heads.store.bytes_per_block
