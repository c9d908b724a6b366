"""Block allocator: hands out integer block ids from a FIFO free queue, with reference counts.

Plain Python bookkeeping, no torch: the allocator owns no bytes, only the ids of the blocks of a
:class:`~kvos.memory.pool.KVPool` (or of any other pool of blocks).

Order is part of the contract. The free queue starts as ``0, 1, 2, ...``; ``alloc`` takes from the
front and a block whose last reference is freed goes to the back (like vLLM's free block queue), so
the ids handed out are predictable and a freed block is reused as late as possible.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from kvos.errors import ConfigError, DoubleFreeError, InvalidBlockError, OutOfBlocksError


class BlockAllocator:
    """Reference-counted free list over the block ids ``0 .. num_blocks - 1``.

    A block is free exactly when its reference count is 0. ``alloc`` sets the count to 1, ``incref``
    shares an allocated block, ``free`` drops one reference and returns the block to the back of the
    free queue when the last one goes. Every operation is O(1) per block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        self._refcount: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        """Total number of block ids managed (free and used)."""
        return len(self._refcount)

    @property
    def num_free(self) -> int:
        """Number of blocks in the free queue."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of blocks with at least one reference."""
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        """Whether ``alloc_n(n)`` would succeed now."""
        return 0 <= n <= self.num_free

    # ------------------------------------------------------------- allocation
    def alloc(self) -> int | None:
        """Take the block at the front of the free queue (refcount 1), or ``None`` when none is free."""
        if not self._free:
            return None
        block_id = self._free.popleft()
        assert self._refcount[block_id] == 0, "a block in the free queue has references"
        self._refcount[block_id] = 1
        return block_id

    def alloc_n(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, all or nothing.

        Raises :class:`OutOfBlocksError` (naming ``requested`` and ``free``) with the state unchanged
        when fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ConfigError(f"alloc_n needs a block count >= 0, got {n}")
        if n > self.num_free:
            raise OutOfBlocksError(requested=n, free=self.num_free)
        ids = [self._free.popleft() for _ in range(n)]
        for block_id in ids:
            self._refcount[block_id] = 1
        return ids

    def incref(self, block_id: int) -> None:
        """Add a reference to an allocated block (share it); it stays used until every reference is freed.

        Raises :class:`InvalidBlockError` for an id out of range or a block that is not allocated.
        """
        self._check_range(block_id)
        if self._refcount[block_id] == 0:
            raise InvalidBlockError(
                f"cannot share block {block_id}: it is free; allocate it first (alloc/alloc_n)"
            )
        self._refcount[block_id] += 1

    def refcount(self, block_id: int) -> int:
        """Number of references to ``block_id`` (0 when it is free)."""
        self._check_range(block_id)
        return self._refcount[block_id]

    # ---------------------------------------------------------------- freeing
    def free(self, block_id: int) -> bool:
        """Drop one reference; return ``True`` when the block went back to the free queue.

        Raises :class:`InvalidBlockError` for an id out of range and :class:`DoubleFreeError` for a
        block that is not allocated.
        """
        self._check_allocated(block_id)
        self._refcount[block_id] -= 1
        if self._refcount[block_id] > 0:
            return False
        self._free.append(block_id)
        return True

    def free_n(self, ids: Iterable[int]) -> None:
        """Drop one reference per listed id, in order; every id is checked first, so an error frees nothing.

        An id may appear more than once (once per reference to drop).
        """
        ids = list(ids)
        for block_id, times in Counter(ids).items():
            self._check_allocated(block_id)
            if times > self._refcount[block_id]:
                raise DoubleFreeError(
                    f"block {block_id} is freed {times} times but has {self._refcount[block_id]} "
                    "reference(s); free each reference once"
                )
        for block_id in ids:
            self.free(block_id)

    # ----------------------------------------------------------------- growth
    def grow(self, new_num_blocks: int) -> None:
        """Manage ``new_num_blocks`` ids; the new ids join the back of the free queue in order."""
        if new_num_blocks < self.num_blocks:
            raise ConfigError(
                f"grow cannot shrink the allocator from {self.num_blocks} to {new_num_blocks} blocks"
            )
        old = self.num_blocks
        self._refcount.extend([0] * (new_num_blocks - old))
        self._free.extend(range(old, new_num_blocks))

    # ----------------------------------------------------------------- checks
    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(
                f"block id {block_id} is out of range: valid ids are 0..{self.num_blocks - 1}; "
                "pass an id that alloc/alloc_n returned"
            )

    def _check_allocated(self, block_id: int) -> None:
        self._check_range(block_id)
        if self._refcount[block_id] == 0:
            raise DoubleFreeError(
                f"block {block_id} is not allocated (already freed or never handed out); "
                "free each allocated block exactly once per reference"
            )
