"""Decode steps through the plan (kvos.model.decode_plan) give bit for bit what the generic layer loop gives,
captured attention included, on every architecture and on GGUF files whose projections stay quantized (one
type, and a llama.cpp-like mix whose fused QKV has parts of two types); steps the plan does not take (a
prefill beside decodes, query capture) still run and agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import write_model
from hf_models import VARIANTS, build

from kvos.engine.engine import Engine
from kvos.model import decode_kernel, layer_kernel
from kvos.model.decode_plan import DecodePlan
from kvos.model.linear import RowStack
from kvos.model.loader import load_model

pytestmark = pytest.mark.skipif(
    layer_kernel.kernel() is None or decode_kernel.kernel() is None, reason="no C++ compiler for the kernels"
)
GGUF_DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)


def _run(path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Three prefills, six batched decode steps, a step mixing a prefill with decodes, one decode step with
    attention captured at every layer and one with queries recorded: every output."""
    model = load_model(path)
    engine = Engine(model, block_size=4)
    seqs = [engine.new_sequence() for _ in range(3)]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (30, 7, 19)]
    logits = list(engine.step(list(zip(seqs, prompts, strict=True))))
    for i in range(6):
        logits += engine.step([(s, [(i * 7 + j) % vocab]) for j, s in enumerate(seqs)])
    logits += engine.step([(seqs[0], [1, 2, 3, 4, 5]), (seqs[1], [6]), (seqs[2], [7])])
    captured: dict[int, torch.Tensor] = {}
    layers = frozenset(range(model.config.num_layers))
    logits.append(engine.extend(seqs[1], [4], capture_layers=layers, captured=captured))
    queries: dict[int, torch.Tensor] = {}
    logits.append(engine.extend(seqs[2], [9], query_layers=layers, queries=queries))
    return logits, [captured[i] for i in sorted(captured)], [queries[i] for i in sorted(queries)]


def _assert_plan_is_the_generic_path(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[bool] = []
    takes = DecodePlan.takes

    def counted(self: DecodePlan, *args: object) -> bool:
        taken.append(takes(self, *args))  # type: ignore[arg-type]
        return taken[-1]

    monkeypatch.setattr(DecodePlan, "takes", counted)
    planned = _run(path)
    assert sum(taken) == 6 + 1  # the six decode steps and the captured one; not the mixed or query steps
    monkeypatch.setattr(DecodePlan, "takes", lambda *args: False)
    generic = _run(path)
    for got, expected in zip(planned, generic, strict=True):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_decode_steps_through_the_plan_equal_the_generic_path(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_plan_is_the_generic_path(build(kind, tmp_path / kind), monkeypatch)


@pytest.mark.parametrize(
    ("qtype", "types"),
    [("Q4_1", None), ("Q5_0", {"v_proj": "Q8_0", "down_proj": "Q6_K"})],
)
def test_quantized_files_through_the_plan_equal_the_generic_path(
    qtype: str, types: dict[str, str] | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_dir = build("qwen2", tmp_path / "hf", **GGUF_DIMS)
    path = tmp_path / "m.gguf"
    write_model(hf_dir, path, "qwen2", qtype, types=types)
    if types:  # the mix keeps each part in its type: the plan's products side by side
        assert isinstance(load_model(path).layers[0].qkv, RowStack)
    _assert_plan_is_the_generic_path(path, monkeypatch)
