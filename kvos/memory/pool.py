"""KV pool: the K and V tensors of every layer, as fixed-size token blocks, grown on demand.

All sequences share one pool; each maps its tokens to blocks with its own
:class:`~kvos.memory.page_table.PageTable`. The pool owns the bytes; a
:class:`~kvos.memory.allocator.BlockAllocator` owns the ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvos.errors import ConfigError, InvalidBlockError, PoolOutOfMemoryError
from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.head_store import HeadStore
from kvos.memory.reserved import grown, physical_bytes, reserve
from kvos.memory.window_rows import NO_ROW, WindowRows

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and device of a KV pool. ``device`` may be given as a string (``"cpu"``).

    ``window_layers``: the layers (ascending) whose K/V are held only inside a sequence's sliding window
    (:mod:`kvos.memory.window_rows`); the others are global, held as long as their block.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    device: torch.device = _CPU
    window_layers: tuple[int, ...] = ()

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
        w = self.window_layers
        if list(w) != sorted(set(w)) or any(not 0 <= i < self.num_layers for i in w):
            raise ConfigError(f"window_layers must be distinct layers in [0, {self.num_layers}), ascending")

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers that are not :attr:`window_layers`."""
        return tuple(i for i in range(self.num_layers) if i not in self.window_layers)

    def _layer_bytes_per_block(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize * self.block_size

    @property
    def global_bytes_per_block(self) -> int:
        """Bytes of K and V for one block over the global layers (what a block costs outside any window;
        0 when every layer slides: a block id is then bookkeeping, its bytes all in window rows)."""
        return len(self.global_layers) * self._layer_bytes_per_block()

    @property
    def growth_bytes_per_block(self) -> int:
        """What the growth policy sizes block ids by: the global layers' bytes (1 when there are none)."""
        return max(self.global_bytes_per_block, 1)

    @property
    def window_bytes_per_block(self) -> int:
        """Bytes of K and V for one block over the window layers (0 without any)."""
        return len(self.window_layers) * self._layer_bytes_per_block()

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers and KV heads (inside every window)."""
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
        num_blocks = self.growth.initial_blocks(layout.block_size, layout.growth_bytes_per_block)
        self.allocator = BlockAllocator(num_blocks)
        globals_ = layout.global_layers
        self._k: list[torch.Tensor] = [self._new_slab(num_blocks) for _ in globals_]  # the global layers'
        self._v: list[torch.Tensor] = [self._new_slab(num_blocks) for _ in globals_]
        self._local = [
            (False, globals_.index(i)) if i in globals_ else (True, layout.window_layers.index(i))
            for i in range(layout.num_layers)
        ]  # layer -> (a window layer?, its local index)
        # bytes held beside the slabs that count against the cap (a hybrid model's recurrent states, one
        # callable per session): the slabs grow only into what they leave
        self.side: dict[Hashable, Callable[[], int]] = {}
        self.rows: WindowRows | None = None
        self._slab_lists: tuple[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
        if layout.window_layers:
            inner = KVLayout(
                len(layout.window_layers),
                layout.num_kv_heads,
                layout.head_dim,
                layout.block_size,
                layout.dtype,
                layout.device,
            )
            self.rows = WindowRows(KVPool(inner, self._unbounded()), num_blocks)
        self.heads: HeadStore | None = None  # created by the first per-head sequence (head_store)
        self.resizes = 0
        self.copy_seconds = 0.0

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.layout.dtype, device=self.layout.device)

    def _new_slab(self, num_blocks: int) -> torch.Tensor:
        """A zero layer tensor of ``num_blocks`` blocks: on the CPU the first blocks of a range reserved for
        the most this pool can hold (:mod:`kvos.memory.reserved`: growing it copies nothing), else (or
        where the range cannot be mapped) a tensor of its own."""
        lay = self.layout
        if lay.device.type == "cpu":
            cap = self.growth.max_blocks(lay.growth_bytes_per_block)
            most = physical_bytes() // lay.growth_bytes_per_block  # every slab's block together
            capacity = max(num_blocks, most if cap is None else min(cap, most))
            full = reserve(lay.block_shape(1)[1:], lay.dtype, capacity)
            if full is not None:
                return full[:num_blocks]
        return self._zeros(lay.block_shape(num_blocks))

    def _unbounded(self) -> GrowthPolicy:
        """This pool's growth without its cap: for an inner pool, which grows within what the cap leaves."""
        g = self.growth
        return GrowthPolicy(g.initial_tokens, g.double_below_tokens, g.step_bytes)

    def head_store(self) -> HeadStore:
        """Where per-head sequences keep their K/V (:mod:`kvos.memory.head_store`): head-blocks of one KV head
        of one layer, counted against this pool's cap with its blocks; created on first use."""
        if self.heads is None:
            lay = self.layout
            inner = KVPool(
                KVLayout(1, 1, lay.head_dim, lay.block_size, lay.dtype, lay.device), self._unbounded()
            )
            self.heads = HeadStore(inner, lay.num_layers, lambda n: self._reserve_inner(inner, n))
        return self.heads

    def _inner_pools(self) -> list[KVPool]:
        """The pools beside the global slabs: the window rows' and the head store's, where they exist."""
        return [
            p
            for p in (
                None if self.rows is None else self.rows.pool,
                None if self.heads is None else self.heads.pool,
            )
            if p is not None
        ]

    @property
    def k(self) -> list[torch.Tensor]:
        """Every layer's K slab (a window layer's is indexed by window slots: :meth:`window_slots`)."""
        return [self._slab(i)[0] for i in range(self.layout.num_layers)]

    @property
    def v(self) -> list[torch.Tensor]:
        """Every layer's V slab, as :attr:`k`."""
        return [self._slab(i)[1] for i in range(self.layout.num_layers)]

    def _slab(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V slabs ``[blocks or rows, block_size, H, D]`` of ``layer``."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is out of range: the pool has {self.layout.num_layers} layers")
        window, local = self._local[layer]
        if window:
            assert self.rows is not None
            return self.rows.pool._k[local], self.rows.pool._v[local]
        return self._k[local], self._v[local]

    def _capacity(self, layer: int) -> int:
        """Blocks (or rows, for a window layer) the slabs of ``layer`` hold."""
        window, _ = self._local[layer]
        return self.rows.pool.num_blocks if window and self.rows is not None else self.num_blocks

    # ------------------------------------------------------------------ window rows
    @property
    def slides(self) -> bool:
        """Whether some layers hold their K/V only inside a window (:mod:`kvos.memory.window_rows`)."""
        return self.rows is not None

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Block slots (int64 ``[n]``) -> the window layers' slots of the same tokens."""
        assert self.rows is not None
        return self.rows.slots(slots, self.layout.block_size)

    def window_locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block slots (int64 ``[n]``) -> window slots and which tokens the window layers still hold (bool
        ``[n]``; :meth:`WindowRows.locate`)."""
        assert self.rows is not None
        return self.rows.locate(slots, self.layout.block_size)

    def claim(self, block_id: int) -> None:
        """One more page table holds ``block_id`` inside its window (no-op without window layers)."""
        if self.rows is not None:
            self.rows.claim(block_id)

    def reclaim(self, block_id: int) -> None:
        """Claim ``block_id``, giving it a window row again where it has none."""
        if self.rows is not None:
            self._reserve_inner(self.rows.pool, 1)
            self.rows.reclaim(block_id)

    def unclaim(self, block_id: int) -> None:
        """A page table no longer holds ``block_id`` inside its window: its window row goes back when no
        table does."""
        if self.rows is not None:
            self.rows.unclaim(block_id)

    def has_row(self, block_id: int) -> bool:
        """Whether the window layers still hold ``block_id`` (always, without window layers)."""
        return self.rows is None or self.rows.row(block_id) != NO_ROW

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
        """Bytes held by all K and V tensors (the window layers' rows included)."""
        inner = sum(p.nbytes for p in self._inner_pools())
        return self.num_blocks * self.layout.global_bytes_per_block + inner

    @property
    def live_bytes(self) -> int:
        """Bytes of the blocks in use, of the window rows in use and of the head-blocks in use."""
        used = self.allocator.num_used * self.layout.global_bytes_per_block
        return used + self.window_live_bytes + self.head_live_bytes

    @property
    def head_live_bytes(self) -> int:
        """Of :attr:`live_bytes`, the head store's (per-head sequences; 0 without any)."""
        return 0 if self.heads is None else self.heads.live_bytes

    @property
    def window_live_bytes(self) -> int:
        """Of :attr:`live_bytes`, the window rows' (0 without window layers)."""
        return 0 if self.rows is None else self.rows.pool.live_bytes

    @property
    def side_bytes(self) -> int:
        """Bytes held beside the slabs that count against the cap (:attr:`side`)."""
        return sum(held() for held in self.side.values())

    def _beside(self) -> int:
        """What the cap must leave for besides the global slabs: the window rows' and the head store's slabs,
        and :attr:`side`."""
        return sum(p.nbytes for p in self._inner_pools()) + self.side_bytes

    def _in_use(self, n: int = 0) -> int:
        """The bytes counted against the cap with ``n`` more blocks: the global layers' blocks, the window
        rows in use (a new block takes one) and :attr:`side`."""
        lay = self.layout
        rows = 0 if self.rows is None else self.rows.num_used + n
        blocks = self.allocator.num_used + n
        held = blocks * lay.global_bytes_per_block + rows * lay.window_bytes_per_block
        return held + self.head_live_bytes + self.side_bytes

    # ------------------------------------------------------------- allocation
    def can_allocate(self, n: int) -> bool:
        """Whether ``alloc_n(n)`` would succeed, growing within the cap if needed; with :attr:`side` bytes,
        whether the blocks in use, ``n`` more and those bytes stay within the cap."""
        cap = self.growth.max_bytes
        if cap is None:
            return True
        free = n <= self.allocator.num_free and (self.rows is None or n <= self.rows.pool.allocator.num_free)
        if free and not self.side:
            return True
        # the side bytes change outside the slabs' growth: with them, what is in use counts, not what was
        # grown (the slabs never grow past what the cap leaves them; their free blocks may be more)
        return self._in_use(n) <= cap

    def out_of_memory(self, n: int) -> PoolOutOfMemoryError:
        """What :meth:`alloc_n` raises when ``n`` more blocks do not fit under the cap: for a caller that
        asked :meth:`can_allocate` first and could not make room."""
        return PoolOutOfMemoryError(
            needed_bytes=self._in_use(n),
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
        if self.rows is None:
            return self.allocator.alloc_n(n)
        self._reserve_inner(self.rows.pool, n)
        ids = self.allocator.alloc_n(n)
        self.rows.attach(ids)
        return ids

    def _reserve_inner(self, inner: KVPool, n: int) -> None:
        """Make room for ``n`` more blocks of ``inner`` (the window rows' or the head store's pool) within
        this pool's cap: every slab and :attr:`side` together."""
        missing = n - inner.allocator.num_free
        if missing <= 0:
            return
        need, per_block, bs = inner.num_blocks + missing, inner.layout.bytes_per_block, self.layout.block_size
        target = inner.growth.blocks_for(inner.num_blocks, need, bs, per_block)
        if self.growth.max_bytes is not None:
            others = self.nbytes - inner.nbytes + self.side_bytes
            target = min(target, (self.growth.max_bytes - others) // per_block)
            if target < need:
                raise PoolOutOfMemoryError(
                    needed_bytes=others + need * per_block,
                    max_bytes=self.growth.max_bytes,
                    pool_bytes=self.nbytes,
                )
        inner._resize(target)

    def alloc(self) -> int:
        """Allocate one block (growing if needed)."""
        return self.alloc_n(1)[0]

    def free(self, block_id: int) -> bool:
        """Drop one reference to ``block_id``; ``True`` when it became free (its window row goes too)."""
        freed = self.allocator.free(block_id)
        if freed and self.rows is not None:
            self.rows.drop(block_id)
        return freed

    def free_n(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; all checked first."""
        ids = list(ids)
        self.allocator.free_n(ids)
        if self.rows is not None:
            for block_id in ids:
                if self.allocator.refcount(block_id) == 0:
                    self.rows.drop(block_id)

    def incref(self, block_id: int) -> None:
        """Share an allocated block."""
        self.allocator.incref(block_id)

    # ----------------------------------------------------------------- growth
    def reserve(self, num_blocks: int) -> None:
        """Grow capacity to at least ``num_blocks`` (to the growth policy's target, within the cap)."""
        lay = self.layout
        per_block = lay.growth_bytes_per_block
        target = self.growth.blocks_for(self.num_blocks, num_blocks, lay.block_size, per_block)
        beside = self._beside()
        if beside and self.growth.max_bytes is not None:  # the inner pools and the side bytes share the cap
            if any([p.shrink() for p in self._inner_pools()]):  # the empty ones give their slabs back first
                beside = self._beside()
            room = (self.growth.max_bytes - beside) // per_block
            if room < num_blocks:
                raise PoolOutOfMemoryError(
                    needed_bytes=num_blocks * per_block + beside,
                    max_bytes=self.growth.max_bytes,
                    pool_bytes=self.nbytes,
                )
            target = min(target, room)
        if target > self.num_blocks:
            self._resize(target)

    def shrink(self) -> bool:
        """Give the memory of an empty pool back: when no block is in use and the pool has grown past its
        initial size, replace every layer tensor by one of the initial size (the next allocations grow it
        again). True when it shrank. Nothing may hold slots of this pool (none are live by then)."""
        if self.heads is not None:
            self.heads.pool.shrink()
        initial = self.growth.initial_blocks(self.layout.block_size, self.layout.growth_bytes_per_block)
        if self.allocator.num_used or self.num_blocks <= initial:
            return False
        self._slab_lists = None  # its views would keep the old slabs alive
        for slabs in (self._k, self._v):
            for layer in range(len(slabs)):
                slabs[layer] = self._new_slab(initial)
        self.allocator = BlockAllocator(initial)
        if self.rows is not None:
            self.rows.reset(initial)
        return True

    def _resize(self, new_num_blocks: int) -> None:
        """Grow every layer tensor to ``new_num_blocks``, one layer at a time, then the allocator: in place
        where its reserved range holds them (:func:`grown`), else by a copy into a new tensor."""
        old = self.num_blocks
        start = time.perf_counter()
        self._slab_lists = None
        for slabs in (self._k, self._v):
            for layer in range(len(slabs)):
                longer = grown(slabs[layer], new_num_blocks)
                if longer is None:
                    longer = self._new_slab(new_num_blocks)
                    longer[:old].copy_(slabs[layer])
                slabs[layer] = longer  # a copied one's old tensor is dropped here: one staged layer at a time
        self._synchronize()
        self.copy_seconds += time.perf_counter() - start
        self.resizes += 1
        self.allocator.grow(new_num_blocks)
        if self.rows is not None:
            self.rows.grow(new_num_blocks)

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
        k_slab, v_slab = self._slab(layer)
        self._flat(k_slab).index_copy_(0, slots, self._cast(k))
        self._flat(v_slab).index_copy_(0, slots, self._cast(v))

    def gather(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at flat slot ids: int64 ``[T]`` -> two ``[T, num_kv_heads, head_dim]``,
        written into ``out`` (two contiguous tensors of that shape and the pool's dtype) when given."""
        slots = self._slot_index(layer, slots)
        k, v = (self._flat(x) for x in self._slab(layer))
        if out is None:
            return k.index_select(0, slots), v.index_select(0, slots)
        torch.index_select(k, 0, slots, out=out[0])
        torch.index_select(v, 0, slots, out=out[1])
        return out

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` seen as ``[num_slots * num_kv_heads, head_dim]``, at ``rows`` (int64 [R],
        ``slot * num_kv_heads + head``): two ``[R, head_dim]``. Several sequences' keys come out head by
        head in one gather (:class:`~kvos.model.attention.DecodeGroup`)."""
        d = self.layout.head_dim
        k, v = (self._flat(x).view(-1, d) for x in self._slab(layer))
        rows = rows.to(k.device)
        return k.index_select(0, rows), v.index_select(0, rows)

    def slabs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` as ``[num_slots, num_kv_heads, head_dim]`` views of the pool's own storage
        (a reader follows slot ids into them; valid until the pool next grows). A window layer's are indexed
        by window slots (:meth:`window_slots`)."""
        k, v = self._slab(layer)
        return self._flat(k), self._flat(v)

    def slab_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`slabs` of every layer, as a list of K views and one of V views: the same lists while the
        slabs stay where they are (a decode step asks for all of them: 30 views made each step were 60 us of
        SmolLM2's 9 ms). A growth or a shrink drops them (their views would keep the old slabs' memory);
        they are also keyed on the slab tensors themselves, for the window rows, which grow on their own (the
        cached views keep those tensors alive, so a key is never reused by another)."""
        held = [*self._k, *self._v]
        if self.rows is not None:
            held += [*self.rows.pool._k, *self.rows.pool._v]
        key = tuple(map(id, held))
        if self._slab_lists is None or self._slab_lists[0] != key:
            views = [self.slabs(layer) for layer in range(self.layout.num_layers)]
            self._slab_lists = key, ([k for k, _ in views], [v for _, v in views])
        return self._slab_lists[1]

    def run_views(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of K and V of ``layer`` at the contiguous flat slots ``start .. start + n - 1``:
        two ``[n, num_kv_heads, head_dim]`` views into the pool (valid until the pool next grows)."""
        k, v = self._slab(layer)
        end = start + n
        if start < 0 or n < 0 or end > self._capacity(layer) * self.layout.block_size:
            raise ValueError(
                f"slots {start}..{end - 1} are out of range for a pool of {self._capacity(layer)} blocks"
            )
        return self._flat(k)[start:end], self._flat(v)[start:end]

    # ----------------------------------------------------------- block access
    def read_blocks(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of whole blocks.

        Returns K and V, each ``[num_layers, len(ids), block_size, num_kv_heads, head_dim]``; a window
        layer's blocks whose window rows are gone read as zeros.
        """
        index = self._block_index(block_ids)
        rows, held = self._row_index(block_ids)
        k: list[torch.Tensor] = []
        v: list[torch.Tensor] = []
        for layer in range(self.layout.num_layers):
            window = self._local[layer][0]
            for out, slab in zip((k, v), self._slab(layer), strict=True):
                part = slab.index_select(0, rows if window else index)
                out.append(part * held[:, None, None, None] if window else part)
        return torch.stack(k), torch.stack(v)

    def _row_index(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The window rows of ``block_ids`` (0 where gone, to read something) and which are held."""
        rows = [0] * len(block_ids) if self.rows is None else self.rows.rows(list(block_ids))
        held = torch.tensor([r != NO_ROW for r in rows], dtype=self.layout.dtype, device=self.layout.device)
        index = torch.tensor([max(r, 0) for r in rows], dtype=torch.long, device=self.layout.device)
        return index, held

    def write_blocks(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Inverse of :meth:`read_blocks`: ``k``, ``v`` each
        ``[num_layers, len(ids), block_size, num_kv_heads, head_dim]`` (cast to the pool's dtype/device)."""
        index = self._block_index(block_ids)
        lay = self.layout
        expected = (lay.num_layers, *lay.block_shape(len(block_ids)))
        _check_shape("k", k, expected)
        _check_shape("v", v, expected)
        k, v = self._cast(k), self._cast(v)
        rows = [] if self.rows is None else self.rows.rows(list(block_ids))
        kept = [i for i, r in enumerate(rows) if r != NO_ROW]  # a window layer writes where it has rows
        row_index = torch.tensor([rows[i] for i in kept], dtype=torch.long, device=lay.device)
        pick = torch.tensor(kept, dtype=torch.long, device=lay.device)
        for layer in range(lay.num_layers):
            k_slab, v_slab = self._slab(layer)
            if self._local[layer][0]:
                k_slab.index_copy_(0, row_index, k[layer].index_select(0, pick))
                v_slab.index_copy_(0, row_index, v[layer].index_select(0, pick))
            else:
                k_slab.index_copy_(0, index, k[layer])
                v_slab.index_copy_(0, index, v[layer])

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
