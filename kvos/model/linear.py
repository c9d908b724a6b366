"""The projection seam: a model weight is either a dense tensor or a :class:`QuantizedWeight`.

Both are kept as torch lays them out, [out, in], rows contiguous. A dense projection of a few activation rows
(a decode step, batched or not: at most :data:`~kvos.model.dense_kernel.SMALL_N`) in float32 runs on
:mod:`kvos.model.dense_kernel`, which reads each weight row once for all rows; more rows (prefill), other
dtypes or no compiled kernel go to torch's matmul (``F.linear`` / ``addmm`` with the weight transposed, a
flag for the BLAS, no copy). A quantized one computes the same products through
:meth:`QuantizedWeight.mm` / :meth:`QuantizedWeight.addmm`. The functions here are all the transformer needs
to stay indifferent to which one it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvos.model import dense_kernel
from kvos.model.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight
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
    small = n <= dense_kernel.SMALL_N and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu"
    if kernel is not None and small and w.is_contiguous():
        fits = c is not None and c.dtype == torch.float32 and c.shape in ((n, out), (out,))
        result = kernel.mm(x.contiguous(), w, c.contiguous() if fits and c is not None else _EMPTY)
        return result if c is None or fits else result + c
    return F.linear(x, w) if c is None else torch.addmm(c, x, w.t())


def fuse(rows: Sequence[Weight]) -> Weight:
    """Projections given as torch weights [out_i, in] (dense or quantized) -> one projection of
    sum(out_i) outputs, [sum out_i, in]. Quantized parts of one layout stay quantized (their rows
    concatenate exactly); a mix is dequantized to float32."""
    quantized = [w for w in rows if isinstance(w, QuantizedWeight)]
    if len(quantized) == len(rows) and len({w.bits for w in quantized}) == 1:
        return QuantizedWeight.cat(quantized)
    dense = [w if isinstance(w, torch.Tensor) else w.dequantize() for w in rows]
    return torch.cat(dense)


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
    lays it out, [vocab, hidden]: usually it is the embedding table itself)."""
    return matmul(hidden, head).float()
