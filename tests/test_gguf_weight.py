"""Weights kept in their GGUF file's own blocks: for every type of llama.cpp's common quantizations the
kernel's dequantization is bit-identical to gguf.quants (SIMD build, portable build, gguf fallback), every
product matches the float32 matmul of those values, the portable build (a CPU without AVX2) agrees with the
SIMD one, fused projections of mixed types stay quantized, and the memory they take is the file's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_files import encode

import kvos.model.gguf_weight as gguf_weight
from kvos.errors import ModelLoadError
from kvos.model import activations
from kvos.model.gguf_kernel import TYPE_IDS, portable_kernel
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.linear import RowStack, fuse
from kvos.model.quant import QuantizedWeight

# A product of float32 values summed in another order: |error| <= MM_RTOL * (|x| @ |W|.T), elementwise.
MM_RTOL = 2e-6
OUT, IN = 40, 768  # three K-quant super-blocks a row; 24 groups of 32


def _raw(qtype: str, rows: int = OUT, cols: int = IN, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return encode(values, qtype, np.random.default_rng(seed))[0]


def _reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    return torch.from_numpy(values)


@pytest.fixture(params=["simd", "portable", "gguf"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The kernel as this CPU builds it, the same source built without intrinsics, or no kernel at all; with
    float32 activations (exact products; int8 activations: tests/test_int8_activations.py)."""
    monkeypatch.setattr(activations, "MODE", "float32")
    module: Any = {"simd": gguf_weight.kernel(), "portable": portable_kernel(), "gguf": None}[request.param]
    if request.param != "gguf" and module is None:
        pytest.skip("the GGUF block kernel cannot be built here (no C++ compiler?)")
    monkeypatch.setattr(gguf_weight, "kernel", lambda: module)
    yield request.param


@pytest.mark.parametrize("qtype", sorted(TYPE_IDS))
def test_dequantize_is_exactly_ggufs(qtype: str, backend: str) -> None:
    raw = _raw(qtype)
    got = GGUFWeight.from_gguf(qtype, raw, (OUT, IN)).dequantize()
    expected = _reference(raw, qtype)
    assert got.dtype == torch.float32 and got.shape == (OUT, IN)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit for bit, signed zeros too


@pytest.mark.parametrize("qtype", sorted(TYPE_IDS))
@pytest.mark.parametrize("n", [1, 3, 4, 7, 33])  # tiles of 4 and their remainders; 33: the float32 tiles
def test_mm_matches_float32_matmul(qtype: str, n: int, backend: str) -> None:
    raw = _raw(qtype, seed=n)
    w = GGUFWeight.from_gguf(qtype, raw, (OUT, IN))
    reference = _reference(raw, qtype)
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(n))
    c = torch.randn(n, OUT, generator=torch.Generator().manual_seed(n + 1))
    for got, expected in ((w.mm(x), x @ reference.t()), (w.addmm(c, x), c + x @ reference.t())):
        bound = MM_RTOL * (x.abs() @ reference.abs().t() + c.abs())
        assert got.shape == (n, OUT)
        assert bool(((got - expected).abs() <= bound).all())


@pytest.mark.parametrize("qtype", sorted(TYPE_IDS))
def test_portable_build_agrees_with_the_simd_build(qtype: str) -> None:
    """The path a CPU without AVX2 takes is tested on this one: the same bytes, the same values."""
    simd, portable = gguf_weight.kernel(), portable_kernel()
    if simd is None or portable is None:
        pytest.skip("the GGUF block kernel cannot be built here (no C++ compiler?)")
    raw = torch.from_numpy(_raw(qtype, seed=3))
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(3))
    type_id = TYPE_IDS[qtype]
    assert torch.equal(simd.dequantize(raw, type_id, IN), portable.dequantize(raw, type_id, IN))
    reference = _reference(raw.numpy(), qtype)
    bound = MM_RTOL * (x.abs() @ reference.abs().t())
    empty = torch.empty(0)
    assert bool(
        ((simd.mm(x, raw, type_id, empty) - portable.mm(x, raw, type_id, empty)).abs() <= bound).all()
    )


@pytest.mark.parametrize("qtype", ["Q5_0", "Q6_K", "IQ4_XS"])
def test_prefill_tiles_cover_every_row(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With float32 activations a prefill's product dequantizes tiles of rows (int8 ones take the panels:
    tests/test_int8_panels.py)."""
    monkeypatch.setattr(activations, "MODE", "float32")
    monkeypatch.setattr(gguf_weight, "TILE_FLOATS", IN * 7)  # tiles of 7 rows: the last one short
    raw = _raw(qtype, seed=4)
    reference = _reference(raw, qtype)
    x = torch.randn(40, IN, generator=torch.Generator().manual_seed(4))
    got = GGUFWeight.from_gguf(qtype, raw, (OUT, IN)).mm(x)
    assert bool(((got - x @ reference.t()).abs() <= MM_RTOL * (x.abs() @ reference.abs().t())).all())


@pytest.mark.parametrize("qtype", ["Q5_0", "Q6_K", "Q3_K"])
def test_row_lookup_is_the_embedding(qtype: str) -> None:
    raw = _raw(qtype, seed=5)
    ids = torch.tensor([3, 0, 39, 3])
    got = GGUFWeight.from_gguf(qtype, raw, (OUT, IN)).index_select(0, ids)
    assert torch.equal(got, _reference(raw, qtype)[ids])


def test_memory_is_the_files() -> None:
    """Kept as the file's blocks: no byte more than the tensor takes in the file."""
    for qtype in TYPE_IDS:
        raw = _raw(qtype)
        assert GGUFWeight.from_gguf(qtype, raw, (OUT, IN)).nbytes == raw.nbytes


def test_mixed_types_fuse_into_a_row_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q5_0 q/k beside a Q8_0 v (llama.cpp's Q4_K_M layout) stay quantized: a RowStack whose product (float32
    activations) and rows are those of the float32 matrix the parts make together."""
    monkeypatch.setattr(activations, "MODE", "float32")
    q = GGUFWeight.from_gguf("Q5_0", _raw("Q5_0", 16, IN, 6), (16, IN))
    k = GGUFWeight.from_gguf("Q5_0", _raw("Q5_0", 8, IN, 7), (8, IN))
    v = QuantizedWeight.from_gguf("Q8_0", _raw("Q8_0", 8, IN, 8), (8, IN))
    fused = fuse([q, k, v])
    assert isinstance(fused, RowStack) and fused.shape == (32, IN)
    assert isinstance(fused.parts[0], GGUFWeight) and fused.parts[0].shape == (24, IN)  # q and k joined
    dense = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(fused.dequantize(), dense)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(9))
    bias = torch.randn(32)
    assert bool(((fused.addmm(bias, x) - (bias + x @ dense.t())).abs() <= 1e-4).all())
    ids = torch.tensor([31, 0, 20, 24])
    assert torch.equal(fused.index_select(0, ids), dense[ids])


def test_same_type_parts_fuse_into_one_weight() -> None:
    parts = [GGUFWeight.from_gguf("Q6_K", _raw("Q6_K", 8, IN, s), (8, IN)) for s in (1, 2)]
    fused = fuse(parts)
    assert isinstance(fused, GGUFWeight) and fused.shape == (16, IN)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_bad_rows_are_a_typed_error() -> None:
    raw = _raw("Q5_0")
    with pytest.raises(ModelLoadError, match="not whole blocks"):
        GGUFWeight.from_gguf("Q5_0", raw[:, :-1], (OUT, IN))
    with pytest.raises(ModelLoadError, match="not kept in GGUF blocks"):
        GGUFWeight.from_gguf("F16", raw, (OUT, IN))
