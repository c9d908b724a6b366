"""Where a product with int8 activations goes from the tiles to the panels, measured on this machine per
weight kind.

The quantized kernels (:mod:`kvos.model.quant_kernel`, :mod:`kvos.model.gguf_kernel`) multiply a few
activation rows by the tiles (each weight row decoded for every four activation rows, a decode step's path)
and many by the panels (:mod:`kvos.model.int8_panels`: eight weight rows decoded once for all of them, a
prefill's). The panels' decoding is a fixed cost a call and the tiles' work grows with the rows, so there is
a row count from which the panels win, and it differs by weight type and by machine: on an AMD EPYC Zen 4
the 4-bit tiles stay faster up to 24 rows at one thread and 48 at two (at 16 rows the panels took 1.4-1.9x
the tiles' time), Q6_K's up to 24-32, while Q5_0's and Q8_0's panels win from 8 rows; on a Zen 5 both
paths matched from 16 rows, the kernels' built-in default. A step of a few decoding sessions beside a
prefill slice, a user message's tail and a reply's re-sync are products of that size.

:func:`tune` measures the crossover once a process for each kind of weight a model has (its largest weight of
that kind, at the thread count the forward passes will use) and sets it in the kernel (``set_panel_rows``);
``kvos serve`` does it at start-up and ``kvos bench decode`` before its runs. Without it the kernels keep
their default. Both paths give the products of the same quantized activations within float32 rounding
(the integer sums are exact; the scaled sums are added in another order; tests assert both), so moving the
switch can turn a greedy reply where two tokens are all but tied, as batching a decode step with another
session's can; on SmolLM2, "count to ten" alone and beside a second session swapped their replies between
the fixed 16 rows and the measured 64.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvos.model import gguf_weight, quant
from kvos.model.gguf_kernel import TYPE_IDS
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.quant import KEPT_TYPES, QuantizedWeight

CANDIDATES = (8, 12, 16, 24, 32, 48, 64, 96)  # the row counts tried, fewest first
BEYOND = 128  # where the panels won at none of them: the tiles up to 127 rows (a prefill slice is more)
Measure = Callable[[int], tuple[float, float]]  # rows -> (seconds of the tiles, seconds of the panels)
Product = Callable[[torch.Tensor], Any]  # x [rows, in] -> x @ W.T
_tuned: dict[tuple[str, int, int, tuple[int, ...]], int] = {}  # (kernel, kind, threads, shape) -> rows


def type_kind(qtype: str) -> int:
    """The kind number ``set_panel_rows`` takes for a weight of GGUF type ``qtype``, in the kernel that keeps
    it: the quantized-weight kernel's 0 (8-bit: Q8_0) or 1 (4-bit with a min: Q4_0, Q4_1, Q4_K), else the GGUF
    block kernel's type id."""
    if qtype in KEPT_TYPES:
        return int(qtype != "Q8_0")
    return TYPE_IDS[qtype]


def crossover(measure: Measure) -> int:
    """The fewest of :data:`CANDIDATES` rows at which the panels took at most the tiles' time, else
    :data:`BEYOND`."""
    for rows in CANDIDATES:
        tiles, panels = measure(rows)
        if panels <= tiles:
            return rows
    return BEYOND


def timed(tiles: Product, panels: Product, width: int) -> Measure:
    """A :data:`Measure` of two products of a weight with ``width`` input features: the best of four runs
    each, alternated, on random activations (the first run warms the weight into the caches)."""

    def measure(rows: int) -> tuple[float, float]:
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        best = [float("inf"), float("inf")]
        for _ in range(4):
            for i, product in enumerate((tiles, panels)):
                began = time.perf_counter()
                product(x)
                best[i] = min(best[i], time.perf_counter() - began)
        return best[0], best[1]

    return measure


def tune(model: Any) -> dict[str, int]:
    """Measure and set, for each kind of kept-quantized weight in ``model``'s layers, the rows from which its
    kernel takes the panels (see the module docstring); returns them by kind ("4-bit", "8-bit" or the GGUF
    type). Kinds whose kernel is not built or has no panels are left out. Measured once a process for each
    kernel, kind, thread count and probe shape."""
    chosen: dict[str, int] = {}
    threads = torch.get_num_threads()
    for label, (module, kind, weight) in _probes(model).items():
        key = (str(module.__name__), kind, threads, tuple(weight.shape))
        if key not in _tuned:
            _tuned[key] = crossover(timed(*_paths(module, weight), weight.shape[1]))
        module.set_panel_rows(kind, _tuned[key])
        chosen[label] = _tuned[key]
    return chosen


def _paths(module: Any, weight: QuantizedWeight | GGUFWeight) -> tuple[Product, Product]:
    """The tiles' and the panels' product of ``weight`` by its kernel ``module``, forced."""
    empty = torch.empty(0)
    if isinstance(weight, QuantizedWeight):
        mins, is4 = (empty, False) if weight.min is None else (weight.min, True)
        bound: tuple[Any, ...] = (weight.q, weight.scale, mins, is4, empty)
    else:
        bound = (weight.raw, TYPE_IDS[weight.qtype], empty)
    return (
        lambda x: module.mm_i8_tiles(x, *bound),
        lambda x: module.mm_i8_panels(x, *bound),
    )


def _probes(model: Any) -> dict[str, tuple[Any, int, QuantizedWeight | GGUFWeight]]:
    """label -> (kernel module, kind, the largest weight of that kind) over ``model``'s layers, for the kinds
    whose kernel is built with panels."""
    probes: dict[str, tuple[Any, int, QuantizedWeight | GGUFWeight]] = {}
    for weight in _layer_weights(model):
        if weight.device.type != "cpu":
            continue
        if isinstance(weight, QuantizedWeight):
            module, kind = quant.kernel(), int(weight.min is not None)
            label = "4-bit" if kind else "8-bit"
        else:
            module, kind, label = gguf_weight.kernel(), TYPE_IDS[weight.qtype], weight.qtype
        if module is None or not module.has_panels():
            continue
        if label not in probes or weight.nbytes > probes[label][2].nbytes:
            probes[label] = (module, kind, weight)
    return probes


def _layer_weights(model: Any) -> Iterator[QuantizedWeight | GGUFWeight]:
    """Every kept-quantized projection of ``model``'s layers, the parts of stacked ones included."""
    for layer in model.layers:
        for weight in layer.projections():
            for part in getattr(weight, "parts", (weight,)):
                if isinstance(part, (QuantizedWeight, GGUFWeight)):
                    yield part
