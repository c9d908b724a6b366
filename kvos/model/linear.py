"""The projection seam: a model weight is either a dense tensor or a :class:`QuantizedWeight`.

A dense projection is stored transposed, [in, out], so it is ``x @ W`` and, with a residual, one ``addmm``
(the fast path, unchanged). A quantized one is kept [out, in] in its groups of 32 along ``in`` and computes
the same products through :meth:`QuantizedWeight.mm` / :meth:`QuantizedWeight.addmm`. The functions here
are all the transformer needs to stay indifferent to which one it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvos.model.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight
"""A projection: dense [in, out] (transposed) or quantized [out, in]; an embedding table: [vocab, hidden]."""


def matmul(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [n, in] -> [n, out]."""
    if isinstance(w, torch.Tensor):
        return x @ w
    return w.mm(x)


def addmm(c: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
    """c [n, out] (or broadcastable) + x [n, in] @ w -> [n, out]."""
    if isinstance(w, torch.Tensor):
        return torch.addmm(c, x, w)
    return w.addmm(c, x)


def fuse(rows: Sequence[Weight]) -> Weight:
    """Projections given as torch weights [out_i, in] (dense or quantized) -> one projection of
    sum(out_i) outputs in the stored form (dense: transposed [in, sum out_i], contiguous). Quantized parts
    of one layout stay quantized (their rows concatenate exactly); a mix is dequantized to float32."""
    quantized = [w for w in rows if isinstance(w, QuantizedWeight)]
    if len(quantized) == len(rows) and len({w.bits for w in quantized}) == 1:
        return QuantizedWeight.cat(quantized)
    dense = [w if isinstance(w, torch.Tensor) else w.dequantize() for w in rows]
    return torch.cat(dense).t().contiguous()


def transposed(w: Weight) -> Weight:
    """A torch weight [out, in] in the stored form (dense: transposed [in, out]; quantized: as is)."""
    return w.t().contiguous() if isinstance(w, torch.Tensor) else w


def embedding(ids: torch.Tensor, table: Weight) -> torch.Tensor:
    """ids int64 [n] -> rows [n, hidden] of the table [vocab, hidden]."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.index_select(0, ids)


def logits(hidden: torch.Tensor, head: Weight) -> torch.Tensor:
    """hidden [n, hidden] @ head [vocab, hidden].T -> float32 logits [n, vocab] (the head is kept as torch
    lays it out, [vocab, hidden], because it is usually the embedding table itself)."""
    if isinstance(head, torch.Tensor):
        return F.linear(hidden, head).float()
    return head.mm(hidden).float()
