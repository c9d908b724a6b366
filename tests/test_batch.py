"""Batched forward passes: several sequences of different lengths in one pass (prefill slices and decode
tokens mixed) give the logits each would get alone, on tiny random models of every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import VARIANTS, build

from kvos.engine.engine import Engine
from kvos.errors import PoolOutOfMemoryError
from kvos.memory.growth import GrowthPolicy
from kvos.model.loader import load_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param))


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= TOL


def test_batched_steps_equal_unbatched(model_path: Path) -> None:
    """Three sequences: a batched prefill of lengths 5, 17 and 9, then mixed steps (decode tokens next to
    prefill slices, one sequence sitting a step out), compared step by step with the same sequences run
    one at a time in their own engine."""
    model = load_model(model_path)
    alone, together = Engine(model, block_size=4), Engine(model, block_size=4)
    solo = [alone.new_sequence() for _ in range(3)]
    batch = [together.new_sequence() for _ in range(3)]
    steps: list[list[tuple[int, list[int]]]] = [
        [(0, _tokens(5, 1)), (1, _tokens(17, 2)), (2, _tokens(9, 3))],
        [(0, [7]), (1, _tokens(6, 4)), (2, [11])],
        [(2, _tokens(13, 5)), (0, [3])],
        [(1, [42]), (0, [8]), (2, [9])],
    ]
    for step in steps:
        got = together.step([(batch[i], ids) for i, ids in step], logits="all")
        for (i, ids), out in zip(step, got, strict=True):
            expected = alone.extend(solo[i], ids, logits="all")
            assert _close(out, expected), f"sequence {i}: max diff {(out - expected).abs().max()}"
    for a, b in zip(solo, batch, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.positions, b.positions)


def test_batched_last_logits_and_hidden_states(model_path: Path) -> None:
    """What each item asks for comes back: the last token's logits [1, vocab], or the hidden states
    [n, hidden]."""
    model = load_model(model_path)
    engine, ref = Engine(model, block_size=4), Engine(model, block_size=4)
    a, b = engine.new_sequence(), engine.new_sequence()
    ra, rb = ref.new_sequence(), ref.new_sequence()
    last = engine.step([(a, _tokens(6, 7)), (b, _tokens(3, 8))], logits="last")
    assert _close(last[0], ref.extend(ra, _tokens(6, 7)))
    assert _close(last[1], ref.extend(rb, _tokens(3, 8)))
    hidden = engine.step([(a, [5]), (b, [6, 7])], logits="none")
    assert hidden[0].shape == (1, model.config.hidden_size) and hidden[1].shape == (
        2,
        model.config.hidden_size,
    )
    assert _close(hidden[1], ref.extend(rb, [6, 7], logits="none"))


def test_step_is_all_or_nothing_when_the_pool_is_full(tmp_path: Path) -> None:
    """A step whose sequences the capped pool cannot all hold changes none of them."""
    model = load_model(build("llama", tmp_path / "m"))
    layout_bytes = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 4 * 4
    engine = Engine(model, block_size=4, growth=GrowthPolicy(initial_tokens=8, max_bytes=3 * layout_bytes))
    a, b = engine.new_sequence(), engine.new_sequence()
    engine.step([(a, _tokens(4, 1)), (b, _tokens(4, 2))])
    used = engine.pool.allocator.num_used
    with pytest.raises(PoolOutOfMemoryError):
        engine.step([(a, [1, 2, 3]), (b, _tokens(8, 3))])
    assert (a.num_tokens, b.num_tokens) == (4, 4)
    assert engine.pool.allocator.num_used == used


def test_decodes_that_attend_together_capture_what_each_would_alone(model_path: Path) -> None:
    """Three decode steps over caches of 5, 19 and 11 tokens attend together (padded to the longest); each
    one's captured attention probabilities [heads, its own keys] and tapped queries equal its step alone."""
    model = load_model(model_path)
    engine, ref = Engine(model, block_size=4), Engine(model, block_size=4)
    layers = frozenset(range(model.config.num_layers))
    prompts = [_tokens(5, 11), _tokens(19, 12), _tokens(11, 13)]
    seqs, refs = [engine.new_sequence() for _ in prompts], [ref.new_sequence() for _ in prompts]
    for seq, rseq, prompt in zip(seqs, refs, prompts, strict=True):
        engine.extend(seq, prompt)
        ref.extend(rseq, prompt)
    items = []
    for i, seq in enumerate(seqs):
        item = engine._item(seq, [20 + i], [seq.next_position()], "last")
        item.meta.capture_layers, item.meta.captured = layers, {}
        item.meta.query_layers, item.meta.queries = layers, {}
        items.append(item)
    outs = model.forward_batch(items, engine.pool)
    for i, (item, rseq) in enumerate(zip(items, refs, strict=True)):
        captured: dict[int, torch.Tensor] = {}
        queries: dict[int, torch.Tensor] = {}
        expected = ref.extend(
            rseq, [20 + i], capture_layers=layers, captured=captured, query_layers=layers, queries=queries
        )
        assert _close(outs[i], expected)
        for layer in layers:
            assert _close(item.meta.captured[layer], captured[layer])
            assert _close(item.meta.queries[layer], queries[layer])
