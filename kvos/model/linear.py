"""The projection seam: a model weight is a dense tensor, a :class:`QuantizedWeight` (repacked groups), a
:class:`GGUFWeight` (the file's own blocks) or a :class:`RowStack` of those (a fused projection whose parts
have different types).

Both are kept as torch lays them out, [out, in], rows contiguous. A dense projection of a few activation rows
(a decode step, batched or not: at most :data:`~kvos.model.dense_kernel.SMALL_N`; a prefill slice too where
the kernel beat the BLAS on this machine, :func:`~kvos.model.dense_kernel.prefill_path`) in float32 runs on
:mod:`kvos.model.dense_kernel`, which reads each weight row once for all rows; more rows, other dtypes or no
compiled kernel go to torch's matmul (``F.linear`` / ``addmm`` with the weight transposed, a
flag for the BLAS, no copy). A quantized one computes the same products through
:meth:`QuantizedWeight.mm` / :meth:`QuantizedWeight.addmm`. The functions here are all the transformer needs
to stay indifferent to which one it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvos.model import dense_kernel
from kvos.model.gguf_kernel import TYPE_IDS
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.quant import KernelProduct, NativePart, QuantizedWeight

Packed = QuantizedWeight | GGUFWeight


@dataclass(frozen=True, eq=False)
class RowStack:
    """Quantized projections of different types stacked by rows: [sum of out_i, in], each part computed in
    its own type and the outputs concatenated (e.g. Q5_0 q/k with a Q8_0 v, as llama.cpp's Q4_K_M files
    have them)."""

    parts: tuple[Packed, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` [n] as float32 [n, in], each read from the part that holds it (dim 0 only)."""
        if dim != 0:
            raise ValueError("a quantized weight selects rows only (dim 0)")
        out = torch.empty(index.numel(), self.shape[1], dtype=torch.float32, device=self.device)
        start = 0
        for part in self.parts:
            end = start + part.shape[0]
            mine = ((index >= start) & (index < end)).nonzero().flatten()
            if mine.numel():
                out[mine] = part.index_select(0, index[mine] - start)
            start = end
        return out

    def mm(self, x: torch.Tensor, int8: bool | None = None) -> torch.Tensor:
        """x [n, in] -> x @ W.T [n, out] (``int8``: as the parts' products take it)."""
        return torch.cat([p.mm(x, int8) for p in self.parts], dim=1)

    def addmm(self, c: torch.Tensor | None, x: torch.Tensor, int8: bool | None = None) -> torch.Tensor:
        """c [n, out] (or broadcastable, or None) + x [n, in] @ W.T."""
        out = self.mm(x, int8)
        return out if c is None else out + c

    def kernel_product(self) -> KernelProduct | None:
        """The parts' kernel products side by side, the outputs concatenated (see
        :meth:`QuantizedWeight.kernel_product`); None unless every part has one."""
        parts = [p.kernel_product() for p in self.parts]
        if any(p is None for p in parts):
            return None
        bound = [p for p in parts if p is not None]

        def stacked(x: torch.Tensor, c: torch.Tensor, int8: bool) -> torch.Tensor:
            out = torch.cat([p(x, _EMPTY, int8) for p in bound], dim=1)
            return out if c.numel() == 0 else out.add_(c)

        return stacked

    def native_parts(self) -> list[NativePart] | None:
        """The parts' products by address, in order (their outputs side by side, as :meth:`kernel_product`);
        None unless every part has them."""
        parts = [p.native_parts() for p in self.parts]
        if any(p is None for p in parts):
            return None
        return [one for p in parts if p is not None for one in p]


Weight = torch.Tensor | QuantizedWeight | GGUFWeight | RowStack


def weight_tensors(weight: Weight | None) -> list[torch.Tensor]:
    """The tensors a weight's products read: itself (dense), a quantized weight's values, scales and mins,
    a GGUF weight's blocks, a stack's parts' in order; none for None."""
    if weight is None:
        return []
    if isinstance(weight, torch.Tensor):
        return [weight]
    if isinstance(weight, QuantizedWeight):
        return [t for t in (weight.q, weight.scale, weight.min) if t is not None]
    if isinstance(weight, GGUFWeight):
        return [weight.raw]
    return [t for part in weight.parts for t in weight_tensors(part)]


"""A projection or an embedding table: dense [out, in] (contiguous) or quantized [out, in]."""

_EMPTY = torch.empty(0)


def matmul(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [n, in] -> x @ w.T [n, out]."""
    if isinstance(w, torch.Tensor):
        return _dense(None, x, w)
    return w.mm(x)


def addmm(c: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
    """c [n, out] (or broadcastable) + x [n, in] @ w.T -> [n, out]."""
    if isinstance(w, torch.Tensor):
        return _dense(c, x, w)
    return w.addmm(c, x)


def _dense(c: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c (or None) + x [n, in] @ w [out, in].T: the kernel for a few float32 rows on the CPU, else torch."""
    kernel = dense_kernel.kernel()
    n, out = x.shape[0], w.shape[0]
    floats = x.dtype == w.dtype == torch.float32 and x.device.type == "cpu" and w.is_contiguous()
    if kernel is not None and floats and dense_kernel.takes(n):
        fits = c is not None and c.dtype == torch.float32 and c.shape in ((n, out), (out,))
        result = dense_kernel.product(
            kernel, x.contiguous(), w, c.contiguous() if fits and c is not None else _EMPTY
        )
        return result if c is None or fits else result + c
    return F.linear(x, w) if c is None else torch.addmm(c, x, w.t())


def cache_aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it that starts on a 64-byte cache line when a CPU tensor does not (a file's memory map,
    numpy's allocations at 16 bytes past a page): a 512-bit load of a row that does not start on a line reads
    two lines, and 8 rows over Qwen2.5-0.5B's 151,936-row head took 1.3x as long 16 bytes off
    (docs/benchmarks.md). The loaders align each tensor as they make it (not the model afterwards: a GGUF's
    weights are made one at a time as the model reads them, so that a load never holds two copies)."""
    if t.device.type == "cpu" and t.data_ptr() % 64 != 0 and t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def fuse(rows: Sequence[Weight]) -> Weight:
    """Projections given as torch weights [out_i, in] (dense or quantized) -> one projection of
    sum(out_i) outputs, [sum out_i, in]. Quantized parts stay quantized: neighbours of one layout are
    joined into one weight (their rows concatenate exactly), and parts of several layouts are kept side by
    side (:class:`RowStack`); a mix with dense parts is dense."""
    if not all(isinstance(w, QuantizedWeight | GGUFWeight) for w in rows):
        return torch.cat([w if isinstance(w, torch.Tensor) else w.dequantize() for w in rows])
    runs: list[list[Packed]] = []
    for w in rows:
        assert isinstance(w, QuantizedWeight | GGUFWeight)
        if runs and _layout(runs[-1][-1]) == _layout(w):
            runs[-1].append(w)
        else:
            runs.append([w])
    joined = [_join(run) for run in runs]
    return joined[0] if len(joined) == 1 else RowStack(tuple(joined))


def _layout(w: Packed) -> tuple[str, int]:
    """What must agree for rows to concatenate: the class and its bits or GGUF type."""
    return ("repacked", w.bits) if isinstance(w, QuantizedWeight) else ("gguf", TYPE_IDS[w.qtype])


def _join(run: list[Packed]) -> Packed:
    if isinstance(run[0], QuantizedWeight):
        return QuantizedWeight.cat([w for w in run if isinstance(w, QuantizedWeight)])
    return GGUFWeight.cat([w for w in run if isinstance(w, GGUFWeight)])


def stored(w: Weight) -> Weight:
    """A torch weight [out, in] in the stored form: dense rows contiguous; quantized as is."""
    return w.contiguous() if isinstance(w, torch.Tensor) else w


def embedding(ids: torch.Tensor, table: Weight) -> torch.Tensor:
    """ids int64 [n] -> rows [n, hidden] of the table [vocab, hidden]."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.index_select(0, ids)


def logits(hidden: torch.Tensor, head: Weight) -> torch.Tensor:
    """hidden [n, hidden] @ head [vocab, hidden].T -> float32 logits [n, vocab] (the head is kept as torch
    lays it out, [vocab, hidden]: usually it is the embedding table itself). A quantized head never takes
    int8 activations (:mod:`kvos.model.activations`): the next token is chosen there, and int8 activations
    in the head alone turn SmolLM2 Q4_1's greedy answer to "What is the capital of France?" from Paris into
    llama.cpp's wrong one. An 8-bit head kept quantized takes int16 blocks in the int8 mode
    (:meth:`QuantizedWeight.logits`); every other one float32 activations."""
    if isinstance(head, torch.Tensor):
        return _dense(None, hidden, head).float()
    if isinstance(head, QuantizedWeight):
        return head.logits(hidden)
    return head.mm(hidden, int8=False).float()
