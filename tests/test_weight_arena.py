"""The projection weights in one arena (:mod:`kvos.model.weight_arena`): ``load_model`` moves every layer's
projections and the head into one block, in the order a decode step reads them, each on a cache line, the
block on a 2 MB boundary and advised huge; every holder reads the moved tensor; the results are the loaded
weights' bit for bit; tensors that share memory stay where they are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runs import three_prefilled
from gguf_files import write_model
from hf_models import build

from kvos.memory.heap import advise_huge_pages
from kvos.model import weight_arena
from kvos.model.linear import RowStack
from kvos.model.loader import load_model
from kvos.model.transformer import Transformer

DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
MIX = {"v_proj": "Q8_0", "down_proj": "Q6_K"}  # a llama.cpp-like mix: QKV in two parts, three kernels


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    hf_dir = build("qwen2", tmp_path / "hf", **DIMS)
    path = tmp_path / "m.gguf"
    write_model(hf_dir, path, "qwen2", "Q5_0", types=MIX)
    return path


def _run(model: Transformer) -> list[torch.Tensor]:
    """Prefills of three sequences and four batched decode steps: every step's logits."""
    engine, seqs, logits = three_prefilled(model, kv_dtype=torch.float16)
    for i in range(4):
        logits += engine.step([(s, [(i * 5 + j) % model.config.vocab_size]) for j, s in enumerate(seqs)])
    return logits


def test_the_projections_lie_in_one_arena_in_decode_order(mixed: Path) -> None:
    model = load_model(mixed)
    arena = model.arena
    assert isinstance(arena, weight_arena.Arena) and isinstance(model.layers[0].qkv, RowStack)
    tensors = list(weight_arena._weight_tensors(model))
    # a layer: QKV's Q5_0 blocks (q, k) and Q8_0 part (v: values, scales), O, gate/up, down; then the head
    assert arena.tensors == len(tensors) == 2 * (1 + 2 + 1 + 1 + 1) + 1
    base = tensors[0].data_ptr()
    assert base % weight_arena.HUGE_PAGE == 0
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    for t, before in zip(tensors[1:], ends, strict=False):  # in order, each on a line, none overlapping
        assert t.data_ptr() % weight_arena.ALIGN == 0 and t.data_ptr() >= before
    assert ends[-1] - base <= arena.nbytes
    # the head is the tied embedding: one object, moved once, and the embedding reads it
    assert model.lm_head is model.embed
    storage = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors)
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert arena.huge  # Linux took the advice (whether it grants 2 MB pages is its call)


def test_the_arena_changes_no_result(mixed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = _run(load_model(mixed))
    monkeypatch.setattr(weight_arena, "pack", lambda model: None)
    loose = load_model(mixed)
    assert loose.arena is None
    for a, b in zip(packed, _run(loose), strict=True):
        assert torch.equal(a, b)


def test_tensors_that_share_memory_stay_and_others_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float model (plain tensors) loaded as it was: a layer whose two projections are views of one tensor
    keeps both where they are, the rest move; packed again, nothing moves (all share the arena); off the CPU
    nothing does."""
    pack = weight_arena.pack
    monkeypatch.setattr(weight_arena, "pack", lambda model: None)
    model = load_model(build("llama", tmp_path / "hf", **DIMS))
    layer = model.layers[0]
    shared = torch.randn(2, *layer.o.shape)
    layer.o, layer.down = shared[0], shared[1][:, : layer.down.shape[1]]
    where = (layer.o.data_ptr(), layer.down.data_ptr())
    head = model.lm_head.data_ptr()
    arena = pack(model)
    assert arena is not None and arena.tensors == len(list(weight_arena._weight_tensors(model))) - 2
    assert (layer.o.data_ptr(), layer.down.data_ptr()) == where
    assert model.lm_head.data_ptr() != head and model.lm_head.data_ptr() % weight_arena.ALIGN == 0
    moved = model.layers[1].qkv.data_ptr()
    assert pack(model) is None and model.layers[1].qkv.data_ptr() == moved
    model.layers = []
    model.lm_head = torch.empty(0, device="meta")
    assert pack(model) is None


def test_the_advice_is_taken_for_whole_pages_only() -> None:
    """``advise_huge_pages`` on a 2 MB-aligned block of a fresh tensor: taken where Linux has transparent
    huge pages; an address inside a page is refused (EINVAL), as is any call off Linux."""
    raw = torch.empty(6 << 20, dtype=torch.uint8)
    start = raw.data_ptr() + (-raw.data_ptr() % weight_arena.HUGE_PAGE)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    assert advise_huge_pages(start, 2 << 20) is thp
    assert advise_huge_pages(start + 1, 4096) is False
