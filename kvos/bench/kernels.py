"""Matmul kernels for weights kept quantized, on SmolLM2-135M's matrix shapes, side by side.

For each matrix (x [n, in] @ W.T -> [n, out]) and each n (1: decode; 64, 512: prefill), every contender is
timed in turn, ``repeats`` times (median), and reported against the dense float32 product kvos runs
(``x @ Wt``, Wt [in, out]). Each contender cycles through its own copies of the matrix, as many as make
64 MiB of float32 weights, so a product reads its weights from memory as a 30-layer model's decode does,
not from a warm cache. Contenders:

- ``dense_f32``: the float32 matmul on the dequantized weights (kvos's ``--dtype float32`` path);
- ``dequant_mm``: dequantize the whole Q4_1 matrix with torch ops, then the float32 matmul;
- ``kvos_q4`` / ``kvos_q8``: :class:`QuantizedWeight` (Q4_1 / Q8_0): the packed-bytes kernel with float32
  activations for n <= ``SMALL_N``, float32 tiles + matmul above; ``kvos_q4_i8`` / ``kvos_q8_i8``: the
  activations quantized to int8 blocks and integer products (:mod:`kvos.model.activations`), by the tiles
  below 16 rows and the panels from 16 (:mod:`kvos.model.int8_panels`); ``kvos_q8_i16``: the output head's
  product, int16 activation blocks (:mod:`kvos.model.int16_blocks`; float32 above ``SMALL_N`` rows);
- ``torch_int4pack``: ``_weight_int4pack_mm_for_cpu`` with Q4_1 mapped exactly (scale d, zero m + 8d);
- ``torch_int8pack``: ``_weight_int8pack_mm``, Q8_0 re-quantized per output channel (lossy).

``rel_err`` is max |y - y_dense| / max |y_dense| for the same weights' values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch

from kvos.bench.common import alternate, header, median, print_table, write_json
from kvos.errors import ConfigError
from kvos.model import activations
from kvos.model.quant import GROUP, QuantizedWeight

SHAPES = {  # name: (in, out), SmolLM2-135M (hidden 576, 9 + 3 + 3 heads of 64, intermediate 1536)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "head": (576, 49152),
}
COLUMNS = ("matrix", "n", "method", "median_us", "vs_dense", "rel_err", "copies")
COPY_BYTES = 64 << 20
Product = Callable[[torch.Tensor], torch.Tensor]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, nargs="+", default=[1, 64, 512], help="activation rows")
    parser.add_argument("--matrices", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--packed-max-n", type=int, default=64, help="largest n for torch's packed kernels (slow)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.repeats < 1 or args.threads < 1 or min(args.n) < 1:
        raise ConfigError("need --repeats, --threads and every --n >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.matrices:
        contenders = _contenders(*SHAPES[name])
        for n in args.n:
            rows.extend(_bench(name, n, contenders, args.repeats, n <= args.packed_max_n))
    result = header("kernels", "SmolLM2-135M shapes")
    result["rows"] = rows
    print_table(rows, COLUMNS)
    write_json(args.json, result)
    return result


def _contenders(in_features: int, out_features: int) -> dict[str, tuple[list[Product], torch.Tensor]]:
    """name -> (one product per copy, the weight values it computes with [out, in])."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    q4 = _quantized(values, "Q4_1")
    q8 = _quantized(values, "Q8_0")
    w4, w8 = q4.dequantize(), q8.dequantize()
    copies = max(1, COPY_BYTES // (4 * in_features * out_features))
    return {
        "dense_f32": ([_dense(w4) for _ in range(copies)], w4),
        "dequant_mm": ([_dequant_mm(_clone(q4)) for _ in range(copies)], w4),
        "kvos_q4": ([_in_mode(_clone(q4).mm, "float32") for _ in range(copies)], w4),
        "kvos_q4_i8": ([_in_mode(_clone(q4).mm, "int8") for _ in range(copies)], w4),
        "kvos_q8": ([_in_mode(_clone(q8).mm, "float32") for _ in range(copies)], w8),
        "kvos_q8_i8": ([_in_mode(_clone(q8).mm, "int8") for _ in range(copies)], w8),
        "kvos_q8_i16": ([_in_mode(_clone(q8).logits, "int8") for _ in range(copies)], w8),
        "torch_int4pack": ([_int4pack(q4) for _ in range(copies)], w4),
        "torch_int8pack": ([_int8pack(w8) for _ in range(copies)], w8),
    }


def _bench(
    name: str, n: int, contenders: dict[str, tuple[list[Product], torch.Tensor]], repeats: int, packed: bool
) -> list[dict[str, Any]]:
    x = torch.randn(n, SHAPES[name][0], generator=torch.Generator().manual_seed(n))
    chosen = {k: v for k, v in contenders.items() if packed or not k.startswith("torch_")}
    runs = {k: _cycle(products, x) for k, (products, _) in chosen.items()}
    for fn in runs.values():
        fn()  # warm-up
    times = alternate(runs, repeats)
    dense = median(times["dense_f32"])
    rows = []
    for method, (products, weights) in chosen.items():
        y, reference = products[0](x), x @ weights.t()
        rows.append(
            {
                "matrix": name,
                "n": n,
                "method": method,
                "median_us": median(times[method]) * 1e6,
                "vs_dense": dense / median(times[method]),
                "rel_err": float((y - reference).abs().max() / reference.abs().max()),
                "copies": len(products),
            }
        )
    return rows


def _cycle(products: list[Product], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call that runs the next copy's product each time."""
    state = [0]

    def call() -> torch.Tensor:
        state[0] = (state[0] + 1) % len(products)
        return products[state[0]](x)

    return call


def _quantized(values: np.ndarray, qtype: str) -> QuantizedWeight:
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    return QuantizedWeight.from_gguf(qtype, raw, values.shape)


def _clone(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(w.q.clone(), w.scale.clone(), None if w.min is None else w.min.clone())


def _in_mode(product: Product, mode: activations.Mode) -> Product:
    """``product`` with its activations as ``mode`` says (int8 blocks or float32; a microsecond a call)."""

    def call(x: torch.Tensor) -> torch.Tensor:
        with activations.using(mode):
            return product(x)

    return call


def _dense(w: torch.Tensor) -> Product:
    wt = w.t().contiguous()  # [in, out], as the transformer stores a dense projection
    return lambda x: x @ wt


def _dequant_mm(w: QuantizedWeight) -> Product:
    """The whole matrix dequantized with torch ops on every call, then the float32 matmul."""
    assert w.min is not None
    out_features, in_features = w.shape
    nibbles = w.q.view(out_features, -1, GROUP // 2)
    scale, mins = w.scale.unsqueeze(-1), w.min.unsqueeze(-1)

    def product(x: torch.Tensor) -> torch.Tensor:
        q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()
        return x @ (q * scale + mins).view(out_features, in_features).t()

    return product


def _int4pack(w: QuantizedWeight) -> Product:
    """torch's int4 CPU kernel computes (q - 8) * scale + zero: Q4_1's d * q + m is scale d, zero m + 8 d."""
    assert w.min is not None
    out_features, in_features = w.shape
    nibbles = w.q.view(out_features, -1, GROUP // 2)
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(out_features, in_features).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    zeros = w.min + 8 * w.scale
    scales_and_zeros = torch.stack((w.scale.t(), zeros.t()), dim=-1).contiguous()  # [in / 32, out, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)


def _int8pack(w: torch.Tensor) -> Product:
    """torch's int8 kernel has one scale per output channel: the values re-quantized to that (lossy)."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return lambda x: torch._weight_int8pack_mm(x, q, scale)
