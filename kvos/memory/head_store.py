"""Head store: the part of a KV pool whose unit is a head-block, so each (layer, KV head) holds its tokens.

A head-block holds K and V of ONE KV head of ONE layer for ``block_size`` tokens. Every layer and head of
every per-head sequence shares one slab pair and one allocator (an inner
:class:`~kvos.memory.pool.KVPool` of one layer and one KV head, whose block ids are head-blocks), so a
head-block one head gives back can be reused by any (layer, head) of any sequence. The owning pool creates
the store on first use and counts its bytes against its cap with its own blocks
(:meth:`KVPool.head_store`). Flat slot ``block * block_size + offset`` indexes ``[head-blocks * block_size,
head_dim]``.

Which tokens a head holds is the business of a :class:`~kvos.memory.head_table.HeadPageTable`, which takes
its head-blocks from this store (it is a :class:`~kvos.memory.page_table.BlockSource`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvos.memory.pool import KVPool


class HeadStore:
    """K/V of per-head sequences: head-blocks in one slab pair, allocated within the owning pool's cap.

    ``pool``: the inner pool (one layer, one KV head); ``reserve(n)``: the owner's check that ``n`` more
    head-blocks fit, growing ``pool`` within its cap (raises :class:`PoolOutOfMemoryError` otherwise).
    """

    def __init__(self, pool: KVPool, num_layers: int, reserve: Callable[[int], None]) -> None:
        self.pool = pool
        self.num_layers = num_layers
        self._reserve = reserve

    # ------------------------------------------------------------ block source
    def alloc_n(self, n: int) -> list[int]:
        """``n`` head-blocks, all or nothing (the pool grows within its cap when too few are free)."""
        self._reserve(n)
        return self.pool.allocator.alloc_n(n)

    def free(self, block_id: int) -> bool:
        """Drop one reference to a head-block; ``True`` when it became free."""
        return self.pool.allocator.free(block_id)

    def incref(self, block_id: int) -> None:
        """Share an allocated head-block."""
        self.pool.allocator.incref(block_id)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of one head-block: ``2 * block_size * head_dim * itemsize``."""
        return self.pool.layout.bytes_per_block

    @property
    def num_used(self) -> int:
        """Head-blocks in use."""
        return self.pool.allocator.num_used

    @property
    def live_bytes(self) -> int:
        """Bytes of the head-blocks in use."""
        return self.pool.live_bytes

    # ----------------------------------------------------------- token access
    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.num_layers} layers")

    def put(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V at flat slots: ``slots`` int64 ``[R]``; ``k``, ``v`` ``[R, head_dim]`` (cast to the
        pool's dtype and device)."""
        d = self.pool.layout.head_dim
        self.pool.write(0, slots, k.reshape(-1, 1, d), v.reshape(-1, 1, d))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at per-head slots: int64 ``[num_kv_heads, T]`` -> two ``[num_kv_heads, T, head_dim]``."""
        self._check_layer(layer)
        k, v = self.pool.gather(0, slots.reshape(-1))
        shape = (*slots.shape, k.shape[2])
        return k.view(shape), v.view(shape)

    def move(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy K/V from each ``(source, destination)`` slot; every source is read before any write."""
        if not moves:
            return
        src = torch.tensor([s for s, _ in moves], dtype=torch.long)
        dst = torch.tensor([d for _, d in moves], dtype=torch.long)
        self.pool.write(0, dst, *self.pool.gather(0, src))

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat slots ``rows`` (int64 [R]): two ``[R, head_dim]``."""
        self._check_layer(layer)
        k, v = self.pool.gather(0, rows)
        return k[:, 0], v[:, 0]

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[num_slots, head_dim]`` views of the store's own slabs (valid until it next grows)."""
        k, v = self.pool.slabs(0)
        return k[:, 0], v[:, 0]
