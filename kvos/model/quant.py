"""Weight matrices kept quantized: GGUF's Q8_0, Q4_0, Q4_1 and Q4_K as int8 or 4-bit groups of 32.

Every kept type is one of two layouts, in groups of 32 consecutive inputs of one output row:

- 8-bit (Q8_0): int8 q [out, in] and a float32 scale per group: w = scale * q; also Q5_0 (d * (q - 16), q
  of 5 bits) on a CPU whose kernels decode its blocks slower than 8-bit groups (:data:`REPACKED_TYPES`);
- 4-bit (Q4_0, Q4_1, Q4_K): q in 0..15 packed two per byte [out, in / 2] (each group's 16 bytes hold its
  elements 0-15 in the low nibbles and 16-31 in the high ones, GGUF's order) with a float32 scale and min
  per group: w = scale * q + min. Q4_1 is this exactly (scale d, min m); Q4_0 is d * (q - 8), so min = -8 d;
  Q4_K's super-block of 256 is 8 groups of 32 with scale d * sc and min -dmin * m.

The scales and mins are products of a float16 and at most a 6-bit integer, exact in float32, and so is
scale * q: the dequantized values are bit-identical to ``gguf.quants.dequantize``. Rows of the same layout
concatenate (fused q/k/v and gate/up projections). A matmul with up to ``SMALL_N`` activation rows (a
decode step, batched or not) runs from the packed bytes (:mod:`kvos.model.quant_kernel`), and so does a
prefill's with int8 activations (panels of eight rows, :mod:`kvos.model.int8_panels`); with float32
activations (or no AVX2) more rows dequantize a tile of at most ``TILE_FLOATS`` weights at a time and call
the float32 matmul, so no float copy of a matrix is ever kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvos.errors import ModelLoadError
from kvos.model import activations
from kvos.model.quant_kernel import kernel

GROUP = 32
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
# Types that can be repacked into the 8-bit layout exactly, where a CPU decodes them slower than 8-bit groups
# (:func:`kvos.model.gguf.repacks_q5_0`): Q5_0's values d * (q - 16) are int8 q - 16 times the scale d.
REPACKED_TYPES = ("Q5_0",)
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22}
BLOCK_VALUES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_0": 32}
# activation rows up to which the packed-bytes kernel beats dequantize + float32 matmul: a decode step of
# up to 32 batched sequences (SmolLM2's shapes, 2 cores: 1.1-1.4x at 32 rows, 5-8x at 8; docs/benchmarks.md)
SMALL_N = 32
KernelProduct = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
"""A product kernel with its weight bound: (x [n, in], c [n, out] or empty, int8) -> c + x @ W.T."""
NativePart = tuple[int, int, int, list[torch.Tensor]]
"""A product kernel by address, for :mod:`kvos.model.step_kernel`: (the int8 entry's address, the float32
entry's, the integer argument, the weight's tensors), called as ``entry(x, tensors, arg, c)`` -> what the
:data:`KernelProduct` of the same weight returns."""
TILE_FLOATS = 1 << 20  # weights dequantized at once on the prefill path (4 MiB of float32)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight matrix [out, in] in groups of 32 along ``in``: ``q`` int8 [out, in] (8-bit) or packed
    uint8 [out, in / 2] (4-bit); ``scale`` float32 [out, in / 32]; ``min`` float32 [out, in / 32] (4-bit)
    or None (8-bit)."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None

    @property
    def bits(self) -> int:
        return 8 if self.min is None else 4

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as torch's [out, in] weight."""
        return int(self.scale.shape[0]), int(self.scale.shape[1]) * GROUP

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of what it computes: float32."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        parts = (self.q, self.scale) if self.min is None else (self.q, self.scale, self.min)
        return sum(t.numel() * t.element_size() for t in parts)

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
        """From a GGUF tensor's rows: ``raw`` uint8 [out, row_bytes] of ``qtype`` blocks; ``shape`` is
        (out, in)."""
        kinds = KEPT_TYPES + REPACKED_TYPES
        if qtype not in kinds:
            raise ModelLoadError(f"tensor type {qtype} is not kept quantized; use one of {kinds}")
        rows, cols = shape
        row_bytes = cols // BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype]
        if cols % BLOCK_VALUES[qtype] or raw.shape != (rows, row_bytes):
            raise ModelLoadError(f"{qtype} tensor of shape {shape} has rows of {raw.shape}, not whole blocks")
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES[qtype])
        if qtype == "Q8_0":
            d = _f16(blocks[..., :2])
            return cls(_tensor(blocks[..., 2:].view(np.int8), rows), _tensor(d, rows), None)
        if qtype == "Q4_K":
            return cls(*_from_q4_k(blocks, rows))
        if qtype == "Q5_0":
            return cls(_tensor(_q5_0_values(blocks), rows), _tensor(_f16(blocks[..., :2]), rows), None)
        d = _f16(blocks[..., :2])
        m = -8 * d if qtype == "Q4_0" else _f16(blocks[..., 2:4])
        return cls(_tensor(blocks[..., -16:], rows), _tensor(d, rows), _tensor(m, rows))

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The rows of ``parts`` stacked, [sum of out, in]; all of one layout and the same ``in``."""
        if len({(p.bits, p.shape[1]) for p in parts}) != 1:
            raise ValueError("only weights of one layout and input size concatenate")
        mins = [p.min for p in parts if p.min is not None]
        return QuantizedWeight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat(mins) if mins else None,
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on ``device`` (off CPU, products go through the tiled dequantize path)."""
        if torch.device(device) == self.device:
            return self
        mins = None if self.min is None else self.min.to(device)
        return QuantizedWeight(self.q.to(device), self.scale.to(device), mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix as ``dtype`` [out, in]."""
        return self._rows(self.q, self.scale, self.min).to(dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` [n] as float32 [n, in] (an embedding lookup); only ``dim`` 0 is supported."""
        if dim != 0:
            raise ValueError("a quantized weight selects rows only (dim 0)")
        index = index.to(self.device)
        mins = None if self.min is None else self.min.index_select(0, index)
        return self._rows(self.q.index_select(0, index), self.scale.index_select(0, index), mins)

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

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head's product: x [n, in] -> float32 [n, out] (:func:`kvos.model.linear.logits`). In
        the int8 mode an 8-bit head takes up to ``SMALL_N`` rows as int16 blocks (``mm_i16``:
        :mod:`kvos.model.int16_blocks`); otherwise, and in the float32 mode, float32 activations."""
        k = kernel()
        xf = x.float().contiguous()
        small = xf.shape[0] <= SMALL_N and self.device.type == "cpu"
        if k is not None and self.min is None and small and activations.int8():
            return k.mm_i16(xf, self.q, self.scale, _EMPTY)
        return self.mm(xf, int8=False)

    def kernel_product(self) -> KernelProduct | None:
        """The kernel's product with this weight's tensors bound: (x float32 [n <= SMALL_N, in] contiguous, c
        float32 [n, out] contiguous or empty, int8) -> c + x @ W.T; None off the CPU or without the kernel."""
        k = kernel()
        if k is None or self.device.type != "cpu":
            return None
        q, scale, is4 = self.q, self.scale, self.min is not None
        mins = _EMPTY if self.min is None else self.min
        i8, f32 = k.mm_i8, k.mm
        return lambda x, c, int8: (i8 if int8 else f32)(x, q, scale, mins, is4, c)

    def native_parts(self) -> list[NativePart] | None:
        """:meth:`kernel_product` by address (one part); None where that is None."""
        k = kernel()
        if k is None or self.device.type != "cpu":
            return None
        i8, f32 = k.entries()
        mins = _EMPTY if self.min is None else self.min
        return [(i8, f32, int(self.min is not None), [self.q, self.scale, mins])]

    def _tiled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [n, in] @ W.T through float32 tiles of at most TILE_FLOATS weights."""
        out_features, in_features = self.shape
        step = max(1, TILE_FLOATS // in_features)
        if step >= out_features:
            return x @ self.dequantize().t()
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
        for a in range(0, out_features, step):
            b = min(a + step, out_features)
            mins = None if self.min is None else self.min[a:b]
            out[:, a:b] = x @ self._rows(self.q[a:b], self.scale[a:b], mins).t()
        return out

    @staticmethod
    def _rows(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
        """Dequantize rows: q int8 [r, in] or uint8 [r, in / 2], scale and mins [r, in / 32] -> float32
        [r, in]."""
        k = kernel()
        if k is not None and q.device.type == "cpu":
            m = _EMPTY if mins is None else mins.contiguous()
            return k.dequantize(q.contiguous(), scale.contiguous(), m, mins is not None)
        r, groups = scale.shape
        if mins is None:
            return (q.view(r, groups, GROUP).float() * scale.unsqueeze(-1)).view(r, -1)
        nibbles = q.view(r, groups, GROUP // 2)
        values = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()
        return (values * scale.unsqueeze(-1) + mins.unsqueeze(-1)).view(r, -1)


_EMPTY = torch.empty(0)


def _f16(halves: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] holding little-endian float16s -> float32 [...]."""
    return np.ascontiguousarray(halves).view(np.float16)[..., 0].astype(np.float32)


def _tensor(values: np.ndarray, rows: int) -> torch.Tensor:
    """A contiguous torch copy of ``values`` as [rows, -1]."""
    return torch.from_numpy(np.ascontiguousarray(values).reshape(rows, -1))


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks uint8 [rows, n, 22] (d, 32 fifth bits, 16 bytes of nibbles) -> int8 [rows, n, 32], the
    blocks' q - 16 (element l: nibble l of the low halves for l < 16, else of the high ones; bit l its
    fifth bit)."""
    high = blocks[..., 2:6].copy().view("<u4")  # [rows, n, 1]
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    nibbles = blocks[..., 6:22]
    low = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)
    return ((low | (fifth << 4)).astype(np.int16) - 16).astype(np.int8)


def _from_q4_k(blocks: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks uint8 [rows, n, 144] (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) -> packed [rows, n * 128], scale and min [rows, n * 8] of the 4-bit layout."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    packed = blocks[..., 4:16].reshape(rows, -1, 3, 4)
    lo, hi, top = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate((lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((hi & 0x3F, (top >> 4) | ((hi >> 2) & 0x30)), axis=-1)
    scale = d[..., None] * sc.astype(np.float32)
    mins = -(dmin[..., None] * mn.astype(np.float32))
    # 4 chunks of 32 bytes: sub-block 2j is chunk j's low nibbles, 2j + 1 its high ones (32 values each)
    chunks = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    values = (chunks & 0x0F).reshape(rows, -1, GROUP)
    q = values[..., :16] | (values[..., 16:] << 4)
    return _tensor(q, rows), _tensor(scale, rows), _tensor(mins, rows)


def kernel_takes(k: Any, rows: int, int8: bool) -> bool:
    """Whether a product of ``rows`` activation rows runs in kernel ``k`` (a quantized-weight extension, or
    None): up to ``SMALL_N`` rows in either mode, any number with int8 activations where ``k`` has the
    panel product (:mod:`kvos.model.int8_panels`); else the float32 tiles."""
    return k is not None and (rows <= SMALL_N or (int8 and bool(k.has_panels())))
