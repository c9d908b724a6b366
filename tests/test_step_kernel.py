"""A decode step's layers as one C++ call (kvos.model.step_kernel) give bit for bit what the decode plan's
Python loop gives: logits and captured attention, on GGUF files whose projections stay quantized (one type,
and a mix whose fused QKV has parts of two types), and on a sliding-window model whose projections are
quantized (the window layers read their own decode group); a model the C++ loop does not run keeps the Python
loop; a plan's handle is freed with it."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_runs import three_prefilled
from gguf_files import encode, write_model
from hf_models import build

from kvos.model import decode_kernel, layer_kernel, step_kernel
from kvos.model.decode_plan import DecodePlan
from kvos.model.gguf import GGUFTensor, kept_quantized
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.linear import RowStack, Weight
from kvos.model.loader import load_model
from kvos.model.quant import QuantizedWeight
from kvos.model.transformer import Transformer

pytestmark = pytest.mark.skipif(
    step_kernel.kernel() is None or layer_kernel.kernel() is None or decode_kernel.kernel() is None,
    reason="no C++ compiler for the kernels",
)
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)


def _steps(model: Transformer, kv_dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Prefills of 30, 7 and 19 tokens, eight batched decode steps (past a 7-token window), one decode step
    of one sequence with attention captured at every layer: [every step's logits, the captured rows, the
    pool's K and V slabs of every layer after them]."""
    engine, seqs, logits = three_prefilled(model, kv_dtype=kv_dtype, window_margin=0)  # window rows recycle
    vocab = model.config.vocab_size
    for i in range(8):
        logits += engine.step([(s, [(i * 7 + j) % vocab]) for j, s in enumerate(seqs)])
    captured: dict[int, torch.Tensor] = {}
    layers = frozenset(range(model.config.num_layers))
    logits.append(engine.extend(seqs[1], [4], capture_layers=layers, captured=captured))
    slabs = [slab.clone() for i in range(model.config.num_layers) for slab in engine.pool.slabs(i)]
    return [logits, [captured[i] for i in sorted(captured)], slabs]


def _assert_native_is_the_python_loop(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = model.decode_plan
    assert plan is not None and plan.native is not None
    calls: list[int] = []
    built = step_kernel.module()
    run = built.run

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return run(*args)

    monkeypatch.setattr(built, "run", counted)

    for kv_dtype in (torch.float32, torch.float16):
        calls.clear()
        native = _steps(model, kv_dtype)
        assert len(calls) == 9  # the eight batched decode steps and the captured one
        handle, plan.native = plan.native, None
        try:
            python = _steps(model, kv_dtype)
        finally:
            plan.native = handle
        for got, expected in zip(native, python, strict=True):
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("qtype", "types"),
    [("Q4_1", None), ("Q5_0", {"v_proj": "Q8_0", "down_proj": "Q6_K"})],
)
def test_quantized_files_through_the_step_kernel_equal_the_python_loop(
    qtype: str, types: dict[str, str] | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_dir = build("qwen2", tmp_path / "hf", **DIMS)
    path = tmp_path / "m.gguf"
    write_model(hf_dir, path, "qwen2", qtype, types=types)
    model = load_model(path)
    if types:  # the mix keeps each part in its type: the parts side by side in C++
        assert isinstance(model.layers[0].qkv, RowStack)
    _assert_native_is_the_python_loop(model, monkeypatch)


def _quantized(weight: torch.Tensor, qtype: str, seed: int) -> Weight:
    """``weight`` as a GGUF file's ``qtype`` matrix, kept quantized as the loader keeps it."""
    raw, _ = encode(weight.float().numpy(), qtype, np.random.default_rng(seed))
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    return kept_quantized(torch.device("cpu"))(GGUFTensor("w", qtype, shape, raw))


def test_a_window_model_with_quantized_projections_equals_the_python_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    windows = dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)  # layer 1 slides
    model = load_model(build("qwen2", tmp_path / "hf", **DIMS, **windows))
    assert model.config.window(0) is None and model.config.window(1) == 7
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.qkv, torch.Tensor) and isinstance(layer.o, torch.Tensor)
        assert isinstance(layer.gate_up, torch.Tensor) and isinstance(layer.down, torch.Tensor)
        q_rows = model.config.num_heads * model.config.head_dim
        q, kv = _quantized(layer.qkv[:q_rows], "Q8_0", i), _quantized(layer.qkv[q_rows:], "Q5_0", i)
        assert isinstance(q, QuantizedWeight) and isinstance(kv, GGUFWeight)  # both kernels' products
        layer.qkv = RowStack((q, kv))
        layer.o = _quantized(layer.o, "Q4_1", i)
        layer.gate_up = _quantized(layer.gate_up, "Q8_0", i)
        layer.down = _quantized(layer.down, "Q6_K", i)
    _assert_native_is_the_python_loop(model, monkeypatch)


def test_dense_weights_keep_the_python_loop(tmp_path: Path) -> None:
    model = load_model(build("qwen2", tmp_path / "hf", **DIMS))
    plan = model.decode_plan
    assert plan is not None and plan.native is None


def test_a_plans_handle_is_freed_with_it(tmp_path: Path) -> None:
    hf_dir = build("qwen2", tmp_path / "hf", **DIMS)
    path = tmp_path / "m.gguf"
    write_model(hf_dir, path, "qwen2", "Q8_0")
    plan = DecodePlan.of(load_model(path))
    assert plan is not None and plan.native is not None
    handle = plan.native
    del plan
    gc.collect()
    x = torch.zeros(1, DIMS["hidden_size"])
    none = torch.empty(0)
    with pytest.raises(RuntimeError, match="no such plan"):
        step_kernel.module().run(handle, x, [], [], [], [], [none] * 5, [none] * 5, none, none, [], [], True)
