"""A model's projection weights in one block of memory, in the order a decode step reads them, on 2 MB pages.

A decode step reads every projection of every layer once, from memory (a model's weights outgrow the caches),
and the products' speed is set by how fast one core streams them. Loaded tensor by tensor, the weights lie
wherever the allocator put each (4 KB pages, the scales of a matrix far from its values), and a core's
hardware prefetchers stop at every 4 KB page boundary while its TLB misses on every page: SmolLM2-135M's
4-bit products read 16-20 GB/s from memory on an AMD Zen 4 core where a sum over a 1 GB buffer reads 24-26.
:func:`pack` copies every layer's projections (their packed bytes, scales and mins; a stacked projection's
parts; a mixture's router and experts) and the output head into one arena, in layer order and each layer's
QKV, O, gate/up, down order, each tensor on a 64-byte boundary, the arena on a 2 MB boundary and advised to
the kernel as huge pages (``madvise(MADV_HUGEPAGE)``; Linux with transparent huge pages at ``madvise`` or
``always``). Each tensor is rebound in place (``Tensor.set_``), so every holder of it (the weights'
dataclasses, a tied embedding, a bound decode plan) reads the arena's copy, and the memory it held is freed.
The values are the same bytes: every result is unchanged.

Measured on a Zen 4, one thread, one activation row, each matrix's weights from memory: 3,072 x 576 (Q4_1)
65.9 us as loaded, 58.6 in a plain arena, 53.3 on 2 MB pages; 576 x 1,536 37.2 / 36.9 / 30.6; 960 x 576
25.8 / 25.5 / 18.7 (docs/benchmarks.md, session 37).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvos.memory.heap import advise_huge_pages, release_free_heap
from kvos.model.linear import weight_tensors

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # a cache line: every tensor starts on one


@dataclass(frozen=True)
class Arena:
    """What :func:`pack` did: the tensors moved, the arena's bytes, whether its pages were advised huge."""

    tensors: int
    nbytes: int
    huge: bool


def pack(model: Any) -> Arena | None:
    """Move ``model``'s projection weights and output head into one arena (see the module docstring); None
    where there is nothing to move (weights off the CPU, or none that is contiguous)."""
    tensors = _unique(t for t in _weight_tensors(model) if t.device.type == "cpu" and t.is_contiguous())
    if not tensors:
        return None
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    raw = torch.empty(total + 2 * HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    arena = raw[start : start + total]
    huge = advise_huge_pages(arena.data_ptr(), total)  # before the copies touch its pages
    with torch.no_grad():
        for t, offset in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            view = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    release_free_heap()  # the loaded copies' pages, freed into the C heap, back to the system
    return Arena(len(tensors), total, huge)


def _weight_tensors(model: Any) -> Iterator[torch.Tensor]:
    """The tensors of every layer's projections in the order a decode step reads them, then the head's."""
    for layer in model.layers:
        for weight in layer.projections():
            yield from weight_tensors(weight)
        experts = layer.experts
        if experts is not None:
            yield experts.router
            for gate_up, down in zip(experts.gate_up, experts.down, strict=True):
                yield from weight_tensors(gate_up)
                yield from weight_tensors(down)
    yield from weight_tensors(model.lm_head)


def _unique(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once (a tied head is the embedding), and only those that own their whole storage, shared
    with no other listed tensor: moving a view would copy its bytes and free none (an arena's tensors are
    such views, so a packed model packs to nothing)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    out: list[torch.Tensor] = []
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            continue
        storage = t.untyped_storage().data_ptr()
        storages[storage] = storages.get(storage, 0) + 1
        out.append(t)
    return [t for t in out if storages[t.untyped_storage().data_ptr()] == 1]
