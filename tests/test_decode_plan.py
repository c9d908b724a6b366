"""Decode steps through the plan (kvos.model.decode_plan) give bit for bit what the generic layer loop gives,
captured attention included, on every architecture and on GGUF files whose projections stay quantized (one
type, and a llama.cpp-like mix whose fused QKV has parts of two types); steps the plan does not take (a
prefill beside decodes, query capture) still run and agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runs import mixed_run
from gguf_files import write_model
from hf_models import VARIANTS, build

from kvos.model import decode_kernel, layer_kernel
from kvos.model.decode_plan import DecodePlan
from kvos.model.linear import RowStack
from kvos.model.loader import load_model

pytestmark = pytest.mark.skipif(
    layer_kernel.kernel() is None or decode_kernel.kernel() is None, reason="no C++ compiler for the kernels"
)
GGUF_DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)


def _assert_plan_is_the_generic_path(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[bool] = []
    takes = DecodePlan.takes

    def counted(self: DecodePlan, *args: object) -> bool:
        taken.append(takes(self, *args))  # type: ignore[arg-type]
        return taken[-1]

    monkeypatch.setattr(DecodePlan, "takes", counted)
    planned = mixed_run(path)
    assert sum(taken) == 6 + 1  # the six decode steps and the captured one; not the mixed or query steps
    monkeypatch.setattr(DecodePlan, "takes", lambda *args: False)
    generic = mixed_run(path)
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
