"""KV pool: the K and V tensors of every layer, as fixed-size token blocks, grown on demand.

All sequences share one pool; each maps its tokens to blocks with its own
:class:`~kvos.memory.page_table.PageTable`. The pool owns the bytes; a
:class:`~kvos.memory.allocator.BlockAllocator` owns the ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvos.errors import ConfigError, InvalidBlockError, PoolOutOfMemoryError
from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and device of a KV pool. ``device`` may be given as a string (``"cpu"``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    device: torch.device = _CPU

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(
                f"{type(self).__name__}.dtype must be a floating torch.dtype, got {self.dtype!r}"
            )
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V for one block over all layers."""
        return self.bytes_per_token * self.block_size

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) tensor: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class KVPool:
    """K and V slabs, one tensor per layer each: ``k[layer]`` has shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Flat slot ``block * block_size + offset`` indexes the view ``[num_blocks * block_size, H, D]``.
    The pool starts at ``growth.initial_blocks`` and grows when an allocation does not fit; a growth
    replaces the layer tensors, so do not keep references to ``k[layer]`` / ``v[layer]`` across calls
    that allocate (``alloc``, ``alloc_n``, ``reserve``, or a page table's ``append``).
    """

    def __init__(self, layout: KVLayout, growth: GrowthPolicy | None = None) -> None:
        self.layout = layout
        self.growth = growth if growth is not None else GrowthPolicy()
        num_blocks = self.growth.initial_blocks(layout.block_size, layout.bytes_per_block)
        self.allocator = BlockAllocator(num_blocks)
        shape = layout.block_shape(num_blocks)
        self.k: list[torch.Tensor] = [self._zeros(shape) for _ in range(layout.num_layers)]
        self.v: list[torch.Tensor] = [self._zeros(shape) for _ in range(layout.num_layers)]
        self.resizes = 0
        self.copy_seconds = 0.0

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.layout.dtype, device=self.layout.device)

    # ------------------------------------------------------------------ sizes
    @property
    def dtype(self) -> torch.dtype:
        """What K and V are kept in (``layout.dtype``)."""
        return self.layout.dtype

    @property
    def num_blocks(self) -> int:
        """Capacity in blocks."""
        return self.allocator.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def live_bytes(self) -> int:
        """Bytes of the blocks in use."""
        return self.allocator.num_used * self.layout.bytes_per_block

    # ------------------------------------------------------------- allocation
    def can_allocate(self, n: int) -> bool:
        """Whether ``alloc_n(n)`` would succeed, growing within the cap if needed."""
        cap = self.growth.max_blocks(self.layout.bytes_per_block)
        return n <= self.allocator.num_free or cap is None or self.allocator.num_used + n <= cap

    def out_of_memory(self, n: int) -> PoolOutOfMemoryError:
        """What :meth:`alloc_n` raises when ``n`` more blocks do not fit under the cap: for a caller that
        asked :meth:`can_allocate` first and could not make room."""
        per_block = self.layout.bytes_per_block
        return PoolOutOfMemoryError(
            needed_bytes=(self.allocator.num_used + n) * per_block,
            max_bytes=self.growth.max_bytes or 0,
            pool_bytes=self.nbytes,
        )

    def alloc_n(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, first growing (one resize) when too few are free.

        Raises :class:`PoolOutOfMemoryError` at the ``max_bytes`` cap, with nothing changed.
        """
        missing = n - self.allocator.num_free
        if missing > 0:
            self.reserve(self.num_blocks + missing)
        return self.allocator.alloc_n(n)

    def alloc(self) -> int:
        """Allocate one block (growing if needed)."""
        return self.alloc_n(1)[0]

    def free(self, block_id: int) -> bool:
        """Drop one reference to ``block_id``; ``True`` when it became free."""
        return self.allocator.free(block_id)

    def free_n(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; all checked first."""
        self.allocator.free_n(ids)

    def incref(self, block_id: int) -> None:
        """Share an allocated block."""
        self.allocator.incref(block_id)

    # ----------------------------------------------------------------- growth
    def reserve(self, num_blocks: int) -> None:
        """Grow capacity to at least ``num_blocks`` (to the growth policy's target, within the cap)."""
        lay = self.layout
        target = self.growth.blocks_for(self.num_blocks, num_blocks, lay.block_size, lay.bytes_per_block)
        if target > self.num_blocks:
            self._resize(target)

    def shrink(self) -> bool:
        """Give the memory of an empty pool back: when no block is in use and the pool has grown past its
        initial size, replace every layer tensor by one of the initial size (the next allocations grow it
        again). True when it shrank. Nothing may hold slots of this pool (none are live by then)."""
        initial = self.growth.initial_blocks(self.layout.block_size, self.layout.bytes_per_block)
        if self.allocator.num_used or self.num_blocks <= initial:
            return False
        shape = self.layout.block_shape(initial)
        for slabs in (self.k, self.v):
            for layer in range(len(slabs)):
                slabs[layer] = self._zeros(shape)
        self.allocator = BlockAllocator(initial)
        return True

    def _resize(self, new_num_blocks: int) -> None:
        """Grow every layer tensor to ``new_num_blocks``, one layer at a time, then the allocator."""
        old = self.num_blocks
        shape = self.layout.block_shape(new_num_blocks)
        start = time.perf_counter()
        for slabs in (self.k, self.v):
            for layer in range(len(slabs)):
                grown = self._zeros(shape)
                grown[:old].copy_(slabs[layer])
                slabs[layer] = grown  # the old tensor is dropped here: one staged layer at a time
        self._synchronize()
        self.copy_seconds += time.perf_counter() - start
        self.resizes += 1
        self.allocator.grow(new_num_blocks)

    def _synchronize(self) -> None:
        """Wait for queued copies on an accelerator so that ``copy_seconds`` is honest."""
        device = self.layout.device
        if device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(device)

    # ----------------------------------------------------------- token access
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V of ``n`` tokens of ``layer`` at flat slot ids.

        ``slots``: int64 ``[n]`` (``block * block_size + offset``, each in range); ``k``, ``v``:
        ``[n, num_kv_heads, head_dim]`` (cast to the pool's dtype and device).
        """
        slots = self._slot_index(layer, slots)
        expected = (slots.shape[0], self.layout.num_kv_heads, self.layout.head_dim)
        _check_shape("k", k, expected)
        _check_shape("v", v, expected)
        self._flat(self.k[layer]).index_copy_(0, slots, self._cast(k))
        self._flat(self.v[layer]).index_copy_(0, slots, self._cast(v))

    def gather(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at flat slot ids: int64 ``[T]`` -> two ``[T, num_kv_heads, head_dim]``,
        written into ``out`` (two contiguous tensors of that shape and the pool's dtype) when given."""
        slots = self._slot_index(layer, slots)
        k, v = self._flat(self.k[layer]), self._flat(self.v[layer])
        if out is None:
            return k.index_select(0, slots), v.index_select(0, slots)
        torch.index_select(k, 0, slots, out=out[0])
        torch.index_select(v, 0, slots, out=out[1])
        return out

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` seen as ``[num_slots * num_kv_heads, head_dim]``, at ``rows`` (int64 [R],
        ``slot * num_kv_heads + head``): two ``[R, head_dim]``. Several sequences' keys come out head by
        head in one gather (:class:`~kvos.model.attention.DecodeGroup`)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.layout.num_layers} layers")
        d = self.layout.head_dim
        k, v = self._flat(self.k[layer]).view(-1, d), self._flat(self.v[layer]).view(-1, d)
        rows = rows.to(k.device)
        return k.index_select(0, rows), v.index_select(0, rows)

    def slabs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as ``[num_slots, num_kv_heads, head_dim]`` views of the pool's own storage
        (a reader follows slot ids into them; valid until the pool next grows)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.layout.num_layers} layers")
        return self._flat(self.k[layer]), self._flat(self.v[layer])

    def run_views(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of K and V of ``layer`` at the contiguous flat slots ``start .. start + n - 1``:
        two ``[n, num_kv_heads, head_dim]`` views into the pool (valid until the pool next grows)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.layout.num_layers} layers")
        end = start + n
        if start < 0 or n < 0 or end > self.num_blocks * self.layout.block_size:
            raise ValueError(
                f"slots {start}..{end - 1} are out of range for a pool of {self.num_blocks} blocks"
            )
        return self._flat(self.k[layer])[start:end], self._flat(self.v[layer])[start:end]

    # ----------------------------------------------------------- block access
    def read_blocks(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of whole blocks.

        Returns K and V, each ``[num_layers, len(ids), block_size, num_kv_heads, head_dim]``.
        """
        index = self._block_index(block_ids)
        k = torch.stack([layer_k.index_select(0, index) for layer_k in self.k])
        v = torch.stack([layer_v.index_select(0, index) for layer_v in self.v])
        return k, v

    def write_blocks(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Inverse of :meth:`read_blocks`: ``k``, ``v`` each
        ``[num_layers, len(ids), block_size, num_kv_heads, head_dim]`` (cast to the pool's dtype/device)."""
        index = self._block_index(block_ids)
        lay = self.layout
        expected = (lay.num_layers, *lay.block_shape(len(block_ids)))
        _check_shape("k", k, expected)
        _check_shape("v", v, expected)
        k, v = self._cast(k), self._cast(v)
        for layer in range(lay.num_layers):
            self.k[layer].index_copy_(0, index, k[layer])
            self.v[layer].index_copy_(0, index, v[layer])

    # ---------------------------------------------------------------- helpers
    def _flat(self, slab: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, block_size, H, D]`` -> view ``[num_blocks * block_size, H, D]``."""
        return slab.view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.layout.device, dtype=self.layout.dtype)

    def _slot_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Check ``layer`` and a 1-D integer ``slots`` tensor; return it as int64 on the pool's device."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.layout.num_layers} layers")
        if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise ValueError(
                f"slots must be a 1-D integer tensor of flat slot ids, got shape {tuple(slots.shape)} "
                f"and dtype {slots.dtype}"
            )
        return slots.to(device=self.layout.device, dtype=torch.long)

    def _block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise InvalidBlockError(
                    f"block id {block_id} is out of range: the pool has {self.num_blocks} blocks"
                )
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.layout.device)


def _check_shape(name: str, x: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {expected}")
