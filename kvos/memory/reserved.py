"""Slabs that grow in place: a pool's layer tensors in address ranges reserved for their largest size.

A pool that grows by allocating larger tensors and copying into them stops every stream for the copy, and
holds both copies of a layer meanwhile: five growths to 8,192 tokens of SmolLM2-135M's float32 K/V copied
94 ms in all, the last 188 MB at once (AMD Zen 5, ``kvos bench growth``), and the copy grows with the pool.

:func:`reserve` maps an anonymous range for a slab's largest size with ``MAP_NORESERVE``: the system commits
no memory for it, and gives a page (zeroed) only when it is first written. A slab is a view of the range's
first blocks, and growing it is a longer view of the same memory: nothing is copied, nothing moves, and a
block's memory is what its first write touched (so the pool's resident bytes stay what it holds).

Where the range cannot be mapped (an address-space limit, strict overcommit), :func:`reserve` gives None
and the pool grows by copying as before.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import weakref

import torch

# Linux's flag (Python has the name from 3.13 on): commit no memory for the range until pages are written
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
# the reserved ranges' flat tensors by address (a tensor compares element by element: no set of them)
_ranges: dict[int, weakref.ref[torch.Tensor]] = {}


def physical_bytes() -> int:
    """The machine's memory in bytes (what no pool can outgrow)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def reserve(block_shape: tuple[int, ...], dtype: torch.dtype, capacity_blocks: int) -> torch.Tensor | None:
    """A zero tensor ``[capacity_blocks, *block_shape]`` of ``dtype`` on the CPU in a range of its own
    whose pages are committed as they are first written; None when the range cannot be mapped. The
    range is unmapped when the tensor and every view of it are gone."""
    nbytes = capacity_blocks * math.prod(block_shape) * dtype.itemsize
    if capacity_blocks < 1 or nbytes == 0:
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    try:
        region = mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, OverflowError, ValueError):
        return None
    flat = torch.frombuffer(region, dtype=dtype)  # holds the mapping until its last view goes
    address = flat.data_ptr()

    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _ranges.pop(address, None)

    _ranges[address] = weakref.ref(flat, forget)
    return flat.view(capacity_blocks, *block_shape)


def grown(slab: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """``slab``'s first ``num_blocks`` blocks in place, when ``slab`` is the first blocks of a range from
    :func:`reserve` that holds that many (the blocks it had keep their contents, the new ones are
    zero); else None (the caller copies)."""
    flat = slab._base
    known = _ranges.get(slab.data_ptr())
    if flat is None or known is None or known() is not flat or not slab.is_contiguous():
        return None
    per_block = math.prod(slab.shape[1:])
    if per_block == 0 or num_blocks * per_block > flat.numel() or flat.dtype != slab.dtype:
        return None
    return flat.view(-1, *slab.shape[1:])[:num_blocks]
