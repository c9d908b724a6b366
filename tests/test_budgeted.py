"""BudgetedSequence and run_budgeted: the engine's own sequences under per-head token budgets; each (layer, KV
head) holds its budget and the rest of its head-blocks go back to the pool; with a budget that keeps
everything, exactly the full-cache Engine's logits (the masked-cache exactness of what they drop is
tests/test_head_segments.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from head_reference import masked_reference

from kvos.engine.engine import Engine
from kvos.model.loader import load_model
from kvos.model.transformer import Transformer
from kvos.policy.budgeted import BudgetedSequence, run_budgeted
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


def test_budget_is_held_and_memory_is_freed(model: Transformer, tokens: list[int]) -> None:
    full = run_budgeted(model, tokens, "uniform", N, block_size=4)
    small = run_budgeted(model, tokens, "h2o", 12, block_size=4)
    assert small.resident_bytes < 0.5 * full.resident_bytes
    assert (small.logits - full.logits).abs().max() > 1e-3  # dropping keys changes the output
    engine = Engine(model, block_size=4)
    policy = POLICIES["h2o"]()
    cache = BudgetedSequence(engine, policy)
    for t in tokens[:30]:
        cache.extend([t])
        cache.enforce(policy.budgets(cache.next_position, 12, cache.rows))
        assert all(cache.num_tokens(*row) == min(12, cache.next_position) for row in cache.rows)
    rows = len(cache.rows)
    assert engine.pool.head_store().num_used == rows * 3  # 12 tokens per head in blocks of 4
    assert cache.resident_bytes == engine.pool.live_bytes == rows * 3 * cache.head_block_bytes
    assert cache.seq.num_blocks == 0  # every token is in the head store
    cache.release()
    assert engine.pool.live_bytes == 0


def test_entropy_rows_hold_their_head_budgets(model: Transformer, tokens: list[int]) -> None:
    calibration = {(0, 0): 0.5, (0, 1): 4.0, (1, 0): 1.0, (1, 1): 2.5}
    policy = POLICIES["entropy"](calibration=calibration)
    engine = Engine(model, block_size=4)
    cache = BudgetedSequence(engine, policy)
    cache.extend(tokens[:40])
    cache.enforce(policy.budgets(40, 10, cache.rows))
    expected = head_budgets(calibration, 40, 10 / 40)  # mean H 2.0: ratios 0.3, 2.0, 0.5, 1.25
    assert expected == {(0, 0): 3, (0, 1): 20, (1, 0): 5, (1, 1): 13}
    assert {row: cache.num_tokens(*row) for row in cache.rows} == expected
    assert engine.pool.head_store().num_used == 1 + 5 + 2 + 4  # ceil(budget / 4) head-blocks per row
    assert cache.uniform_bytes() == 4 * 3 * cache.head_block_bytes  # 41 tokens: 11 per row


def test_stories260k_full_budget_equals_the_engine(shared_dir: Path) -> None:
    """A real pretrained model (llama2.c format, 8 query heads over 4 KV heads): same logits as the Engine."""
    path = shared_dir / "models" / "stories260K" / "stories260K.bin"
    if not path.exists():
        pytest.skip(f"{path} not present")
    stories = load_model(path)
    ids = [1, *torch.randint(3, 512, (95,), generator=torch.Generator().manual_seed(2)).tolist()]
    run = run_budgeted(stories, ids, "snapkv", 96, prefill=40)
    assert (run.logits - engine_logits(stories, ids, 40)[:-1]).abs().max() <= 1e-4


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_what_the_policies_read_counts_every_query_once(
    model: Transformer, tokens: list[int], policy: str
) -> None:
    """Each query's attention sums to 1 over the keys its heads hold: the cumulative sums over a prefill of
    n tokens and k steps add up to n + k per query head (dropped keys or not), and SnapKV's observation
    window is a mean of such rows."""
    c = model.config
    chooser = POLICIES[policy]()
    cache = BudgetedSequence(Engine(model, block_size=4), chooser)
    cache.extend(tokens[:PREFILL])
    for k, t in enumerate(tokens[PREFILL : PREFILL + 12], start=1):
        cache.extend([t])
        cache.enforce(chooser.budgets(cache.next_position, 10, cache.rows))
        if policy == "h2o":
            sums = cache._cum.sum(dim=2)  # [L, H]
            assert torch.allclose(
                sums, torch.full((c.num_layers, c.num_heads), float(PREFILL + k)), atol=1e-3
            )
        else:
            window = cache.window_scores()
            assert window is not None and window.shape == (c.num_layers, c.num_heads, PREFILL + k)
            assert torch.allclose(window.sum(dim=2), torch.ones(c.num_layers, c.num_heads), atol=1e-4)
    assert all(cache.num_tokens(*row) == 10 for row in cache.rows)
