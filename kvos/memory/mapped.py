"""Host tensors in memory of their own: saved K/V that outlives requests, mapped apart from the C heap.

A server saves evicted chunks for as long as their session lives (hundreds of MB at a soak's peak), while
requests make and drop small objects in between. Allocated from malloc, a chunk's tensor lands in a heap
that the request's small objects also use; when the sessions go, a few small survivors on every other
page keep the heap's pages resident (a full soak ended 39 MB above its start that way,
docs/reliability.md). glibc would map blocks of 128 KiB and more on their own, but it raises that
threshold to the largest block freed so far, so after the first evictions it stops doing so.

:func:`mapped_empty` gives a large tensor an anonymous mapping of its own (``mmap``), unmapped when the
tensor is freed: its pages go back to the system at once, whatever else the heap holds. Small tensors
(under :data:`MAPPED_MIN_BYTES`), and any where the mapping fails (the process' mapping count is capped by
``vm.max_map_count``), come from ``torch.empty`` as before.
"""

from __future__ import annotations

import math
import mmap

import torch

MAPPED_MIN_BYTES = 64 << 10  # smaller tensors come from the heap: a mapping costs a system call and a page


def mapped_empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``; on the CPU and at least
    :data:`MAPPED_MIN_BYTES` large, it lives in an anonymous mapping of its own that is unmapped when the
    tensor (and every view of it) is freed (other devices: ``torch.empty``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES or torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # out of mappings (vm.max_map_count) or of address space: the heap will do
        return torch.empty(shape, dtype=dtype)
    # the tensor holds the mapping (its buffer export) until the last view of it goes
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def mapped_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` (any device), in a mapping of its own when large enough."""
    out = mapped_empty(t.shape, t.dtype)
    out.copy_(t.detach())
    return out
