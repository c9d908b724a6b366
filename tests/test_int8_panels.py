"""The many-row product with int8 activations (:mod:`kvos.model.int8_panels`): eight weight rows decoded once
into a panel and multiplied with every activation row in integers. Its products are those of the activations
as quantized (as the few-row kernels' are), for every type of both weight kernels, at the integer extremes
where 16-bit partial sums would overflow, with rows past the last panel, in every build; a prefill of a
quantized weight takes it in the int8 mode and the float32 tiles in the float32 mode."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_files import encode
from test_int8_activations import BUILDS, _assert_product, _dense

import kvos.model.gguf_weight as gguf_weight
import kvos.model.quant as quant
from kvos.model import activations, gguf_kernel, panel_rows
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.quant import KEPT_TYPES, QuantizedWeight

IN = 768  # three K-quant super-blocks a row
ROWS = 43  # five panels of eight and a last one of three
GGUF_TYPES = sorted(gguf_kernel.TYPE_IDS)


def _build(name: str) -> tuple[Any, Any]:
    pair = BUILDS[name]()
    if None in pair:
        pytest.skip("the kernels cannot be built here (no C++ compiler?)")
    return pair


# Where each type's float16 scales lie in its block, and the byte that puts every integer of a block at its
# type's far end: all bits set for the unsigned and offset types (15, 31, 63, 3, 7 after the shift), -128 for
# Q8_0 (read as 128 by the sign trick), nibble 0 for the IQ4 types (-127).
F16_AT = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
FILL = {"Q8_0": 0x80, "IQ4_NL": 0x00, "IQ4_XS": 0x00}


def _extreme_raw(qtype: str, rows: int) -> np.ndarray:
    """Blocks of ``qtype`` whose integers are all at the type's far end, their float16 scales 1/64."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = np.full((rows, IN // block_values, block_bytes), FILL.get(qtype, 0xFF), dtype=np.uint8)
    for at in F16_AT[qtype]:
        raw[:, :, at : at + 2] = np.frombuffer(np.float16(1 / 64).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def _products(build: tuple[Any, Any], qtype: str, raw: np.ndarray, x: torch.Tensor) -> list[torch.Tensor]:
    """(tiles, panels, automatic) products of x with the weight ``raw`` by the kernel that keeps its type."""
    empty = torch.empty(0)
    if qtype in KEPT_TYPES:
        w = QuantizedWeight.from_gguf(qtype, raw, (raw.shape[0], IN))
        mins, is4 = (empty, False) if w.min is None else (w.min, True)
        k = build[0]
        return [f(x, w.q, w.scale, mins, is4, empty) for f in (k.mm_i8_tiles, k.mm_i8_panels, k.mm_i8)]
    blocks, type_id, k = torch.from_numpy(raw), gguf_kernel.TYPE_IDS[qtype], build[1]
    return [f(x, blocks, type_id, empty) for f in (k.mm_i8_tiles, k.mm_i8_panels, k.mm_i8)]


def _random_raw(qtype: str, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((ROWS, IN)).astype(np.float32)
    return encode(values, qtype, np.random.default_rng(seed))[0]


@pytest.mark.parametrize("build_name", sorted(BUILDS))
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_panels_are_the_products_of_the_quantized_activations(qtype: str, build_name: str) -> None:
    """Every type, 1-40 activation rows (a tail of the four-row loop), 43 weight rows (a short last panel):
    the panels' products are x_q @ W.T within float32 rounding, and so are the tiles' and the automatic
    choice's (the tiles below 16 rows, the panels from 16)."""
    build = _build(build_name)
    raw = _random_raw(qtype, seed=5)
    dense = _dense(raw, qtype)
    for n in (1, 6, 16, 40):
        x = torch.randn(n, IN, generator=torch.Generator().manual_seed(n))
        for got in _products(build, qtype, raw, x):
            _assert_product(got, x, dense, None)


@pytest.mark.parametrize("build_name", sorted(BUILDS))
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_integer_extremes_do_not_overflow(qtype: str, build_name: str) -> None:
    """Activations at +-127 in every lane against weights at their types' largest integers: the 16-bit
    partial sums are widened before they can overflow (an overflow is off by 65,536 units: far outside the
    bound)."""
    build = _build(build_name)
    raw = _extreme_raw(qtype, ROWS)
    dense = _dense(raw, qtype)
    x = torch.ones(8, IN)
    x[1::2] = -1.0  # every activation 127, or -127
    x[2] = torch.where(dense[0] > 0, 1.0, -1.0)  # same sign as row 0's weights: the largest sums
    for got in _products(build, qtype, raw, x):
        _assert_product(got, x, dense, None)


def test_the_builds_say_whether_they_have_panels() -> None:
    """The SIMD builds (native, and AVX2 without AVX-512) have the panel product; a CPU without AVX2 does not,
    and its prefill keeps the float32 tiles."""
    assert _build("simd")[0].has_panels() and _build("simd")[1].has_panels()
    assert _build("avx2")[0].has_panels() and _build("avx2")[1].has_panels()
    assert not _build("portable")[0].has_panels() and not _build("portable")[1].has_panels()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0", "Q6_K"])
def test_a_prefill_takes_the_panels_in_the_int8_mode(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A product of more rows than a decode step (40 > SMALL_N) where the weight's kind takes the panels
    (the kernels' default of 16 rows, set here, whatever a server in this process measured): in the int8
    mode it is the panels' own output, bit for bit, and the residual is added in the kernel; in the float32
    mode it is the float32 tiles'."""
    build = _build("simd")
    monkeypatch.setattr(quant, "kernel", lambda: build[0])
    monkeypatch.setattr(gguf_weight, "kernel", lambda: build[1])
    raw = _random_raw(qtype, seed=2)
    kind = QuantizedWeight if qtype in KEPT_TYPES else GGUFWeight
    w = kind.from_gguf(qtype, raw, (ROWS, IN))
    module = build[0] if qtype in KEPT_TYPES else build[1]
    number = panel_rows.type_kind(qtype)
    before = module.set_panel_rows(number, 0)
    try:
        x = torch.randn(40, IN, generator=torch.Generator().manual_seed(2))
        c = torch.randn(40, ROWS, generator=torch.Generator().manual_seed(3))
        panels = _products(build, qtype, raw, x)[1]
        monkeypatch.setattr(activations, "MODE", "int8")
        assert torch.equal(w.mm(x), panels)
        _assert_product(w.addmm(c, x), x, _dense(raw, qtype), c)
        monkeypatch.setattr(activations, "MODE", "float32")
        assert torch.equal(w.mm(x), w._tiled_mm(x))
        assert not torch.equal(w.mm(x), panels)
    finally:
        module.set_panel_rows(number, before)
