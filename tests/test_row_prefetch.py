"""Where the decode products' rows asked for ahead go (:mod:`kvos.model.row_prefetch`): the level is chosen
per CPU (L2 on an AMD Zen 4, L1 elsewhere, ``KVOS_ROW_PREFETCH`` over both), each kernel module is loaded
with it, and it changes no product: every type's products at L1 and at L2 are equal bit for bit in every
build."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from gguf_files import encode
from test_int8_activations import BUILDS
from test_int8_panels import GGUF_TYPES, IN

from kvos.errors import ConfigError
from kvos.model import gguf_kernel, quant_kernel, row_prefetch
from kvos.model.quant import KEPT_TYPES, QuantizedWeight

ROWS = 96  # rows enough that the products ask for rows ahead (8 KB: 21 of 384 bytes) and stop at the end


def _cpu(vendor: str, family: int, flags: str) -> str:
    """A two-processor /proc/cpuinfo whose second processor says something else (only the first is read)."""
    first = (
        f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\nflags\t\t: {flags}\n"
    )
    second = "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: fpu avx512f\n"
    return first + "\n" + second


ZEN4 = _cpu("AuthenticAMD", 25, "fpu sse avx2 fma avx512f avx512bw avx512_vnni")
ZEN3 = _cpu("AuthenticAMD", 25, "fpu sse avx2 fma")
ZEN5 = _cpu("AuthenticAMD", 26, "fpu sse avx2 fma avx512f avx512bw avx512_vnni")
XEON = _cpu("GenuineIntel", 6, "fpu sse avx2 fma avx512f avx512bw avx512_vnni")


@pytest.mark.parametrize(
    ("cpuinfo", "level"),
    [(ZEN4, 1), (ZEN3, 0), (ZEN5, 0), (XEON, 0), ("", 0)],
    ids=["zen4", "zen3", "zen5", "xeon", "none"],
)
def test_the_level_is_chosen_by_the_cpu(cpuinfo: str, level: int) -> None:
    assert row_prefetch.machine_level(cpuinfo, env="") == level


def test_the_variable_overrides_the_cpu_and_a_bad_value_is_refused() -> None:
    assert row_prefetch.machine_level(ZEN4, env="L1") == 0
    assert row_prefetch.machine_level(XEON, env="l2") == 1
    with pytest.raises(ConfigError, match="KVOS_ROW_PREFETCH must be one of L1, L2, got 'L3'"):
        row_prefetch.machine_level(XEON, env="L3")


def test_the_kernels_load_with_this_machines_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel()`` of both modules is at :func:`machine_level`; ``apply`` sets a module to what the variable
    says; a level other than 0 or 1 is refused and the setting kept."""
    modules = [m for m in (quant_kernel.kernel(), gguf_kernel.kernel()) if m is not None]
    if not modules:
        pytest.skip("the kernels cannot be built here (no C++ compiler?)")
    expected = row_prefetch.machine_level()
    try:
        for module in modules:
            assert module.prefetch_level_of() == expected
            for value, level in (("L2", 1), ("L1", 0)):
                monkeypatch.setenv(row_prefetch.ENV, value)
                assert row_prefetch.apply(module) is module
                assert module.prefetch_level_of() == level
            with pytest.raises(RuntimeError, match="the prefetch level is 0 \\(L1\\) or 1 \\(L2\\), got 2"):
                module.set_prefetch_level(2)
            assert module.prefetch_level_of() == 0
            assert module.set_prefetch_level(1) == 0  # returns the level before
    finally:
        monkeypatch.delenv(row_prefetch.ENV, raising=False)
        for module in modules:
            row_prefetch.apply(module)
    assert row_prefetch.apply(None) is None


@pytest.fixture(params=sorted(BUILDS))
def build(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    pair = BUILDS[request.param]()
    if None in pair:
        pytest.skip("the kernels cannot be built here (no C++ compiler?)")
    levels = [m.prefetch_level_of() for m in pair]
    yield pair
    for module, level in zip(pair, levels, strict=True):
        module.set_prefetch_level(level)


def _products(pair: tuple[Any, Any], qtype: str, raw: np.ndarray, x: torch.Tensor) -> list[torch.Tensor]:
    """Every few-row product of x with the weight ``raw`` (int8 and float32 activations; the int16 head's for
    Q8_0) by the kernel that keeps its type."""
    empty = torch.empty(0)
    if qtype in KEPT_TYPES:
        w, k = QuantizedWeight.from_gguf(qtype, raw, (ROWS, IN)), pair[0]
        mins, is4 = (empty, False) if w.min is None else (w.min, True)
        out = [f(x, w.q, w.scale, mins, is4, empty) for f in (k.mm_i8_tiles, k.mm)]
        return out + ([k.mm_i16(x, w.q, w.scale, empty)] if w.min is None else [])
    blocks, type_id, k = torch.from_numpy(raw), gguf_kernel.TYPE_IDS[qtype], pair[1]
    return [f(x, blocks, type_id, empty) for f in (k.mm_i8_tiles, k.mm)]


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_the_level_changes_no_product(qtype: str, build: tuple[Any, Any]) -> None:
    """One and three activation rows (a decode step, a batch of three): the same outputs at either level."""
    values = np.random.default_rng(7).standard_normal((ROWS, IN)).astype(np.float32)
    raw = encode(values, qtype, np.random.default_rng(7))[0]
    for n in (1, 3):
        x = torch.randn(n, IN, generator=torch.Generator().manual_seed(n))
        by_level = []
        for level in (0, 1):
            for module in build:
                module.set_prefetch_level(level)
            by_level.append(_products(build, qtype, raw, x))
        for at_l1, at_l2 in zip(*by_level, strict=True):
            assert torch.equal(at_l1, at_l2)
