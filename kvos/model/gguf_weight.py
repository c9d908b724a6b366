"""Weight matrices kept in their GGUF file's own blocks (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL, ...).

A :class:`GGUFWeight` holds the file's bytes, one row of blocks per output: it takes the file's size in memory
and no more. The block kernel (:mod:`kvos.model.gguf_kernel`) multiplies up to ``SMALL_N`` activation rows (a
decode step) from those bytes, and any number with int8 activations (panels of eight decoded rows,
:mod:`kvos.model.int8_panels`; :func:`kvos.model.quant.kernel_takes` is the rule); with float32 activations
(or no AVX2) more rows dequantize a tile of at most ``TILE_FLOATS`` weights at a time and call the float32
matmul, so no float copy of a matrix is ever kept. The kernel's dequantization is bit-identical to
``gguf.quants.dequantize``, which is also the fallback when no kernel can be built.

Rows of one type concatenate (fused projections); projections of different types are kept side by side by
:class:`RowStack`, each read in its own type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from kvos.errors import ModelLoadError
from kvos.model import activations
from kvos.model.gguf_kernel import TYPE_IDS, kernel
from kvos.model.quant import KernelProduct, NativePart, kernel_takes

TILE_FLOATS = 1 << 20  # weights dequantized at once on the prefill path (4 MiB of float32)
_EMPTY = torch.empty(0)


def block_layout(qtype: str) -> tuple[int, int]:
    """(values, bytes) of one block of GGUF type ``qtype``."""
    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return int(values), int(nbytes)


@dataclass(frozen=True, eq=False)
class GGUFWeight:
    """A weight matrix [out, in] as GGUF blocks: ``raw`` uint8 [out, in / values * bytes] of ``qtype``."""

    raw: torch.Tensor
    qtype: str
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as torch's [out, in] weight."""
        return int(self.raw.shape[0]), self.cols

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of what it computes: float32."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> GGUFWeight:
        """From a GGUF tensor's rows: ``raw`` uint8 [out, row_bytes] of ``qtype`` blocks (copied, so the
        file's mapping may close); ``shape`` is (out, in)."""
        if qtype not in TYPE_IDS:
            raise ModelLoadError(f"tensor type {qtype} is not kept in GGUF blocks; one of {list(TYPE_IDS)}")
        rows, cols = shape
        values, nbytes = block_layout(qtype)
        if cols % values or raw.shape != (rows, cols // values * nbytes):
            raise ModelLoadError(f"{qtype} tensor of shape {shape} has rows of {raw.shape}, not whole blocks")
        return cls(torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)), qtype, cols)

    @staticmethod
    def cat(parts: Sequence[GGUFWeight]) -> GGUFWeight:
        """The rows of ``parts`` stacked, [sum of out, in]; all of one type and the same ``in``."""
        if len({(p.qtype, p.cols) for p in parts}) != 1:
            raise ValueError("only weights of one type and input size concatenate")
        return GGUFWeight(torch.cat([p.raw for p in parts]), parts[0].qtype, parts[0].cols)

    def to(self, device: torch.device | str) -> GGUFWeight:
        """The same weight on ``device`` (off CPU, products go through the tiled dequantize path)."""
        if torch.device(device) == self.device:
            return self
        return GGUFWeight(self.raw.to(device), self.qtype, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix as ``dtype`` [out, in]."""
        return self._rows(self.raw).to(dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` [n] as float32 [n, in] (an embedding lookup); only ``dim`` 0 is supported."""
        if dim != 0:
            raise ValueError("a quantized weight selects rows only (dim 0)")
        return self._rows(self.raw.index_select(0, index.to(self.device)))

    def mm(self, x: torch.Tensor, int8: bool | None = None) -> torch.Tensor:
        """x [n, in] -> x @ W.T [n, out], float32 (x is cast to float32 first), then back to x's dtype."""
        return self.addmm(None, x, int8)

    def addmm(self, c: torch.Tensor | None, x: torch.Tensor, int8: bool | None = None) -> torch.Tensor:
        """c [n, out] (or broadcastable, or None) + x [n, in] @ W.T, computed in float32, as x's dtype.
        ``int8``: whether a small product quantizes ``x`` to int8 blocks (:mod:`kvos.model.activations`;
        None: the mode in force)."""
        xf = x.float().contiguous()
        product = self.kernel_product()
        int8 = activations.int8() if int8 is None else int8
        if product is not None and kernel_takes(kernel(), xf.shape[0], int8):
            fused = c is not None and c.dtype == torch.float32 and c.shape == (xf.shape[0], self.shape[0])
            add = c.contiguous() if fused and c is not None else _EMPTY
            out = product(xf, add, int8)
            if c is not None and not fused:
                out += c
        else:
            out = self._tiled_mm(xf)
            if c is not None:
                out += c
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def kernel_product(self) -> KernelProduct | None:
        """The block kernel's product with this weight's bytes bound, as
        :meth:`kvos.model.quant.QuantizedWeight.kernel_product`; None off the CPU or without the kernel."""
        k = kernel()
        if k is None or self.device.type != "cpu":
            return None
        raw, type_id, i8, f32 = self.raw, TYPE_IDS[self.qtype], k.mm_i8, k.mm
        return lambda x, c, int8: (i8 if int8 else f32)(x, raw, type_id, c)

    def native_parts(self) -> list[NativePart] | None:
        """:meth:`kernel_product` by address (one part); None where that is None."""
        k = kernel()
        if k is None or self.device.type != "cpu":
            return None
        i8, f32 = k.entries()
        return [(i8, f32, TYPE_IDS[self.qtype], [self.raw])]

    def _tiled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [n, in] @ W.T through float32 tiles of at most TILE_FLOATS weights."""
        out_features, in_features = self.shape
        step = max(1, TILE_FLOATS // in_features)
        if step >= out_features:
            return x @ self.dequantize().t()
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
        for a in range(0, out_features, step):
            b = min(a + step, out_features)
            out[:, a:b] = x @ self._rows(self.raw[a:b]).t()
        return out

    def _rows(self, raw: torch.Tensor) -> torch.Tensor:
        """Dequantize rows uint8 [r, row_bytes] -> float32 [r, in]."""
        k = kernel()
        if k is not None and raw.device.type == "cpu":
            return k.dequantize(raw.contiguous(), TYPE_IDS[self.qtype], self.cols)
        values = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(values.astype(np.float32, copy=False)).to(raw.device)
