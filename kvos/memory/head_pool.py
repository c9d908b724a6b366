"""Head pool: K/V storage whose unit is a head-block, so each (layer, KV head) can hold its own tokens.

A head-block holds K and V of ONE KV head of ONE layer for ``block_size`` tokens. All layers and heads share
one slab pair (``k``, ``v``: ``[num_blocks, block_size, head_dim]``) and one
:class:`~kvos.memory.allocator.BlockAllocator`, so a head-block that one head frees can be reused by any
(layer, head). Flat slot ``block * block_size + offset`` indexes the view ``[num_blocks * block_size,
head_dim]``. The pool grows on demand like :class:`~kvos.memory.pool.KVPool` (same
:class:`~kvos.memory.growth.GrowthPolicy`, in units of head-blocks).

Which tokens a head holds is the business of a :class:`~kvos.memory.head_table.HeadPageTable`;
:func:`drop_tokens` applies one of its compactions to the tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.head_table import HeadPageTable
from kvos.memory.pool import KVLayout


@dataclass(frozen=True)
class HeadLayout(KVLayout):
    """A :class:`KVLayout` (same fields and checks) whose unit of storage is a head-block: K and V of one
    KV head of one layer for ``block_size`` tokens."""

    @property
    def bytes_per_head_block(self) -> int:
        """Bytes of K and V of one head-block: ``2 * block_size * head_dim * itemsize``."""
        return 2 * self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_head_token(self) -> int:
        """Bytes of K and V of one token in one (layer, KV head)."""
        return 2 * self.head_dim * self.dtype.itemsize


class HeadPool:
    """K and V slabs of head-blocks, ``[num_blocks, block_size, head_dim]`` each, grown on demand.

    A growth replaces ``k`` and ``v``: do not keep references to them across calls that allocate.
    """

    def __init__(self, layout: HeadLayout, growth: GrowthPolicy | None = None) -> None:
        self.layout = layout
        self.growth = growth if growth is not None else GrowthPolicy()
        num_blocks = self.growth.initial_blocks(layout.block_size, layout.bytes_per_head_block)
        self.allocator = BlockAllocator(num_blocks)
        self.k = self._zeros(num_blocks)
        self.v = self._zeros(num_blocks)
        self.resizes = 0
        self.copy_seconds = 0.0

    def _zeros(self, num_blocks: int) -> torch.Tensor:
        lay = self.layout
        shape = (num_blocks, lay.block_size, lay.head_dim)
        return torch.zeros(shape, dtype=lay.dtype, device=lay.device)

    def new_table(self) -> HeadPageTable:
        """An empty per-head page table of one sequence over this pool."""
        lay = self.layout
        return HeadPageTable(lay.num_layers, lay.num_kv_heads, lay.block_size, self)

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        """Capacity in head-blocks."""
        return self.allocator.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V slabs (capacity, used or not)."""
        return self.num_blocks * self.layout.bytes_per_head_block

    @property
    def resident_bytes(self) -> int:
        """Bytes of the head-blocks in use: ``num_used * bytes_per_head_block``."""
        return self.allocator.num_used * self.layout.bytes_per_head_block

    live_bytes = resident_bytes

    # ------------------------------------------------------------- allocation
    def alloc_n(self, n: int) -> list[int]:
        """Allocate ``n`` head-blocks, growing once when too few are free (:class:`PoolOutOfMemoryError`
        at the cap, with nothing changed)."""
        missing = n - self.allocator.num_free
        if missing > 0:
            self.reserve(self.num_blocks + missing)
        return self.allocator.alloc_n(n)

    def free(self, block_id: int) -> bool:
        """Drop one reference to ``block_id``; ``True`` when it became free."""
        return self.allocator.free(block_id)

    def incref(self, block_id: int) -> None:
        """Share an allocated head-block."""
        self.allocator.incref(block_id)

    def free_n(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; all checked first."""
        self.allocator.free_n(ids)

    def reserve(self, num_blocks: int) -> None:
        """Grow capacity to at least ``num_blocks`` head-blocks (to the growth policy's target)."""
        lay = self.layout
        target = self.growth.blocks_for(self.num_blocks, num_blocks, lay.block_size, lay.bytes_per_head_block)
        if target <= self.num_blocks:
            return
        start = time.perf_counter()
        old = self.num_blocks
        for name in ("k", "v"):
            grown = self._zeros(target)
            grown[:old].copy_(getattr(self, name))
            setattr(self, name, grown)
        self.copy_seconds += time.perf_counter() - start
        self.resizes += 1
        self.allocator.grow(target)

    # ----------------------------------------------------------- token access
    def _flat(self, slab: torch.Tensor) -> torch.Tensor:
        return slab.view(-1, self.layout.head_dim)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.layout.num_layers} layers")

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V of ``n`` new tokens of ``layer``, each KV head at its own slots.

        ``slots``: int64 ``[num_kv_heads, n]``; ``k``, ``v``: ``[n, num_kv_heads, head_dim]`` (cast to the
        pool's dtype and device). Satisfies the model's ``KVStore`` protocol for per-head metadata.
        """
        self._check_layer(layer)
        hd = self.layout.head_dim
        index = slots.reshape(-1).to(device=self.layout.device, dtype=torch.long)
        for name, x in (("k", k), ("v", v)):
            if x.dim() != 3 or x.shape[1] != slots.shape[0] or x.shape[0] != slots.shape[1]:
                raise ValueError(f"{name} {tuple(x.shape)} does not match slots {tuple(slots.shape)}")
            rows = x.transpose(0, 1).reshape(-1, hd).to(device=self.layout.device, dtype=self.layout.dtype)
            self._flat(getattr(self, name)).index_copy_(0, index, rows)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at per-head slots: int64 ``[num_kv_heads, T]`` -> two ``[num_kv_heads, T, head_dim]``."""
        self._check_layer(layer)
        index = slots.reshape(-1).to(device=self.layout.device, dtype=torch.long)
        shape = (*slots.shape, self.layout.head_dim)
        return (
            self._flat(self.k).index_select(0, index).view(shape),
            self._flat(self.v).index_select(0, index).view(shape),
        )

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at per-head slots ``rows`` (int64 [R]): two ``[R, head_dim]``. A slot of this pool holds
        one KV head already, so a row is a slot (the ``KVStore`` protocol's row gather)."""
        self._check_layer(layer)
        index = rows.to(device=self.layout.device, dtype=torch.long)
        return self._flat(self.k).index_select(0, index), self._flat(self.v).index_select(0, index)

    @property
    def dtype(self) -> torch.dtype:
        """What K and V are kept in (``layout.dtype``)."""
        return self.layout.dtype

    def slabs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[num_slots, 1, head_dim]`` views (a slot of this pool holds one KV head)."""
        self._check_layer(layer)
        hd = self.layout.head_dim
        return self._flat(self.k).view(-1, 1, hd), self._flat(self.v).view(-1, 1, hd)

    def read_slots(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V at flat slots: two ``[len(slots), head_dim]``."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.layout.device)
        return self._flat(self.k).index_select(0, index), self._flat(self.v).index_select(0, index)

    def move(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy K/V from each ``(source, destination)`` slot; every source is read before any write."""
        if not moves:
            return
        device = self.layout.device
        src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=device)
        for slab in (self.k, self.v):
            flat = self._flat(slab)
            flat.index_copy_(0, dst, flat.index_select(0, src))


def drop_tokens(pool: HeadPool, table: HeadPageTable, layer: int, kv_head: int, keep: Sequence[int]) -> int:
    """Keep only row indices ``keep`` (strictly increasing) of ``(layer, kv_head)``: move the survivors
    down in the pool (order kept) and free the emptied head-blocks. Returns how many were freed."""
    moves, freed = table.drop(layer, kv_head, keep)
    pool.move(moves)
    return len(freed)
