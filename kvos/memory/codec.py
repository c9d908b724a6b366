"""The chunk store's codec: a saved tensor stored dense or sparse, whichever takes fewer bytes.

Sparse form: a packed bitmask with one bit per element (``numpy.packbits``, big-endian bit order within a
byte, C order over the tensor) that is set where the element is nonzero, then the nonzero elements in
their own dtype, in C order. A tensor of ``n`` elements of ``s`` bytes, ``nnz`` of them nonzero, takes
``ceil(n / 8) + nnz * s`` bytes sparse and ``n * s`` dense; :func:`encode` picks sparse only when it is
strictly smaller (so a tensor with no zeros, or an empty one, stays dense).

"Zero" means all bits zero: +0.0 only. A -0.0 has its sign bit set, so it is stored as a value like any
other, and decoding is bit-exact for every element, -0.0, NaN payloads and infinities included.
Magnitude sparsification (:mod:`kvos.policy.sparsify`) writes +0.0, so its zeros are the ones that pack.

The codec is torch + numpy only; :mod:`kvos.memory.store` puts its payload into chunk files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvos.memory.mapped import mapped_empty

CODEC_NAME = "bitmask"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sparse_nbytes(numel: int, nnz: int, itemsize: int) -> int:
    """Bytes of the sparse form: ``ceil(numel / 8)`` mask bytes plus ``nnz * itemsize`` value bytes."""
    return (numel + 7) // 8 + nnz * itemsize


def _as_bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as same-width integers, so "nonzero" means "bits not all zero" (-0.0 counts)."""
    return x.contiguous().view(_BITS[x.dtype.itemsize])


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor in dense or sparse form (CPU).

    Dense: ``values`` is the tensor itself and ``mask`` is None. Sparse: ``values`` is 1-D ``[nnz]`` in the
    tensor's dtype and ``mask`` is the packed bitmask, uint8 ``[ceil(numel / 8)]``.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    values: torch.Tensor
    mask: np.ndarray | None = None

    @property
    def sparse(self) -> bool:
        return self.mask is not None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def raw_bytes(self) -> int:
        """Bytes of the dense tensor."""
        return self.numel * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of this form: the payload it contributes to a chunk file, and what it holds in RAM."""
        mask_bytes = 0 if self.mask is None else int(self.mask.nbytes)
        return mask_bytes + self.values.numel() * self.dtype.itemsize

    def decode(self) -> torch.Tensor:
        """The tensor, bit-exact (dense: the stored tensor itself, treat it as read-only)."""
        if self.mask is None:
            return self.values
        keep = np.unpackbits(self.mask, count=self.numel).view(np.bool_)
        out = torch.zeros(self.numel, dtype=self.dtype)
        out[torch.from_numpy(keep)] = self.values
        return out.reshape(self.shape)

    def spec(self) -> dict[str, Any]:
        """Header fields that :func:`from_payload` needs to read this tensor back."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "form": "sparse" if self.sparse else "dense",
            "nnz": int(self.values.numel()),
        }

    def buffers(self) -> list[memoryview]:
        """Payload bytes: the mask (sparse only), then the values, C-contiguous, native byte order."""
        values = self.values.contiguous().reshape(-1).view(torch.uint8).numpy().data
        return [values] if self.mask is None else [self.mask.data, values]


def encode(x: torch.Tensor) -> EncodedTensor:
    """``x`` (a CPU tensor of any shape and floating dtype) in its smaller form; dense keeps ``x`` itself."""
    shape = tuple(x.shape)
    numel, itemsize = x.numel(), x.dtype.itemsize
    if numel == 0 or itemsize not in _BITS:
        return EncodedTensor(x.dtype, shape, x)
    bits = _as_bits(x)
    nnz = int(torch.count_nonzero(bits))  # a reduction: no mask is built unless sparse wins
    if sparse_nbytes(numel, nnz, itemsize) >= numel * itemsize:
        return EncodedTensor(x.dtype, shape, x)
    keep = (bits != 0).reshape(-1)
    values = x.contiguous().reshape(-1)[keep].clone()
    return EncodedTensor(x.dtype, shape, values, np.packbits(keep.numpy()))


def from_payload(spec: dict[str, Any], payload: memoryview, offset: int) -> tuple[EncodedTensor, int]:
    """Read one tensor described by ``spec`` (see :meth:`EncodedTensor.spec`; a spec without ``form`` is
    dense) from ``payload`` at ``offset``; returns it and the offset after it.

    Raises ValueError (or KeyError/TypeError) when the spec or the payload is malformed.
    """
    dtype, shape = getattr(torch, str(spec["dtype"]), None), tuple(int(n) for n in spec["shape"])
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {spec['dtype']!r}")
    numel = int(torch.Size(shape).numel())
    form = spec.get("form", "dense")
    if form == "dense":
        dense = _take(payload, offset, numel, dtype).reshape(shape)
        return EncodedTensor(dtype, shape, dense), offset + numel * dtype.itemsize
    if form != "sparse":
        raise ValueError(f"unknown tensor form {form!r}")
    nnz, mask_bytes = int(spec["nnz"]), (numel + 7) // 8
    if not 0 <= nnz <= numel or offset + mask_bytes > len(payload):
        raise ValueError("sparse tensor spec does not fit the payload")
    mask = np.frombuffer(bytearray(payload[offset : offset + mask_bytes]), dtype=np.uint8)
    if int(np.unpackbits(mask, count=numel).sum()) != nnz:
        raise ValueError("sparse mask does not match its nonzero count")
    offset += mask_bytes
    values = _take(payload, offset, nnz, dtype)
    return EncodedTensor(dtype, shape, values, mask), offset + nnz * dtype.itemsize


def _take(payload: memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``count`` elements of ``dtype`` copied from ``payload`` at ``offset`` (a large one in
    a mapping of its own: it is kept in the store's RAM tier, :mod:`kvos.memory.mapped`)."""
    nbytes = count * dtype.itemsize
    if offset + nbytes > len(payload):
        raise ValueError("payload shorter than the tensors in the header")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    out = mapped_empty((nbytes,), torch.uint8)
    out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=offset)
    return out.view(dtype)
