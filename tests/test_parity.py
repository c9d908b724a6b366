"""kvos logits equal transformers' on tiny random checkpoints of every supported architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import VARIANTS, build, hf_model

from kvos.engine.engine import Engine
from kvos.model.loader import load_model

TOL = 1e-4
PROMPT = 23
DECODE_STEPS = 6


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    kind = request.param
    return kind, build(kind, tmp_path_factory.mktemp(kind))


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def test_prefill_logits_match(checkpoint: tuple[str, Path]) -> None:
    _, path = checkpoint
    ids = _tokens(PROMPT, 1)
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0]
    engine = Engine(load_model(path), block_size=4)
    got = engine.extend(engine.new_sequence(), ids, logits="all")
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


def test_prefill_then_decode_match(checkpoint: tuple[str, Path]) -> None:
    """Greedy decode step by step; every step's logits equal a full HF forward over the same tokens.
    A second sequence interleaved in the pool makes the first one's blocks non-contiguous."""
    _, path = checkpoint
    ref = hf_model(path)
    engine = Engine(load_model(path), block_size=3)
    seq, other = engine.new_sequence(), engine.new_sequence()
    ids = _tokens(PROMPT, 2)
    logits = engine.extend(seq, ids[:10])[0]
    engine.extend(other, _tokens(5, 3))
    logits = engine.extend(seq, ids[10:])[0]
    for _ in range(DECODE_STEPS):
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0, -1]
        assert (logits - expected).abs().max().item() <= TOL
        token = int(torch.argmax(expected))
        ids.append(token)
        engine.extend(other, [token])
        logits = engine.decode(seq, token)
    blocks = seq.segments[0].page_table.blocks
    assert blocks != list(range(blocks[0], blocks[0] + len(blocks))), "blocks should be non-contiguous"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close(tmp_path: Path, dtype: torch.dtype) -> None:
    path = build("qwen2", tmp_path)
    ids = _tokens(PROMPT, 4)
    with torch.no_grad():
        expected = hf_model(path, torch.float32)(torch.tensor([ids])).logits[0]
    model = load_model(path, dtype=dtype)
    assert model.embed.dtype == dtype
    engine = Engine(model, block_size=4)
    assert engine.pool.k[0].dtype == dtype
    got = engine.extend(engine.new_sequence(), ids, logits="all")
    assert (got - expected).abs().max().item() < 0.1


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    path = build("llama", tmp_path, shard_size="30KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = _tokens(PROMPT, 5)
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0, -1]
    engine = Engine(load_model(path))
    got = engine.extend(engine.new_sequence(), ids)[0]
    assert (got - expected).abs().max().item() <= TOL
