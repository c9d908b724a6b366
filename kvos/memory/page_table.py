"""Page table: maps a sequence's token indices to physical (block, offset) slots.

Plain Python bookkeeping, no torch. Blocks come from a :class:`BlockSource` (a
:class:`~kvos.memory.allocator.BlockAllocator`, or a :class:`~kvos.memory.pool.KVPool`, which grows
its tensors on demand).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvos.errors import ConfigError, InvalidPositionError


class BlockSource(Protocol):
    """Where a page table gets its blocks and gives them back."""

    def alloc_n(self, n: int) -> list[int]:
        """Return ``n`` block ids, all or nothing (raise and change nothing when it cannot)."""
        ...

    def free(self, block_id: int) -> bool:
        """Drop one reference to ``block_id``; ``True`` when the block became free."""
        ...

    def incref(self, block_id: int) -> None:
        """Add one reference to an allocated ``block_id`` (a second table now shares it)."""
        ...


@runtime_checkable
class WindowSource(Protocol):
    """A block source whose sliding-window layers hold a block only while a table claims it
    (:class:`~kvos.memory.pool.KVPool` with window layers: :mod:`kvos.memory.window_rows`). A block comes
    from ``alloc_n`` claimed once."""

    @property
    def slides(self) -> bool: ...

    def claim(self, block_id: int) -> None: ...

    def reclaim(self, block_id: int) -> None: ...

    def unclaim(self, block_id: int) -> None: ...


class PageTable:
    """A sequence's token indices -> (block, offset).

    Token ``i`` lives in logical block ``i // block_size`` at offset ``i % block_size``; the table maps
    each logical block to a physical block id of the source. Its flat slot id is
    ``block * block_size + offset``, the row index into a pool layer viewed as
    ``[num_blocks * block_size, num_kv_heads, head_dim]``.

    There is one shared row of block ids for now. The table is shaped so that a (layer, kv_head) can
    later get its own row (per-head paging, where heads keep different tokens and free memory for
    real): readers should ask for :meth:`row` with their (layer, kv_head) rather than :attr:`blocks`.

    Over a source with sliding-window layers (:class:`WindowSource`), the table also knows from which
    token on those layers still hold its tokens (:attr:`held_from`); :meth:`slide` moves that point on and
    gives back the blocks it leaves (their global layers stay).
    """

    def __init__(self, block_size: int, source: BlockSource) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be a positive number of tokens, got {block_size}")
        self.block_size = block_size
        self.source = source
        self._blocks: list[int] = []
        self._num_tokens = 0
        self._held_from = 0
        slides = isinstance(source, WindowSource) and source.slides
        self._window: WindowSource | None = source if slides else None  # type: ignore[assignment]

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        """Number of token slots reserved."""
        return self._num_tokens

    @property
    def num_blocks(self) -> int:
        """Number of blocks held (``ceil(num_tokens / block_size)``)."""
        return len(self._blocks)

    @property
    def blocks(self) -> list[int]:
        """A copy of the shared row: physical block id of each logical block."""
        return list(self._blocks)

    def row(self, layer: int, kv_head: int) -> list[int]:
        """Block ids of ``(layer, kv_head)``: a copy of the shared row, the same for every head for now.

        This is the seam for per-head paging: once heads can keep different tokens, each
        (layer, kv_head) will get its own row, and callers that already ask per head keep working.
        """
        if layer < 0 or kv_head < 0:
            raise InvalidPositionError(f"layer and kv_head must be >= 0, got ({layer}, {kv_head})")
        return list(self._blocks)

    def _blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ window layers
    @property
    def held_from(self) -> int:
        """The first token the window layers still hold (0 without window layers; tokens before it have
        slid out of every window this table will read)."""
        return self._held_from

    def _claimed_from(self, held_from: int, num_tokens: int) -> int:
        """The first logical block this table claims for its window layers, given ``held_from``."""
        return (
            self._blocks_for_tokens(num_tokens) if held_from >= num_tokens else held_from // self.block_size
        )

    def slide(self, held_from: int) -> None:
        """The window layers no longer need tokens before ``held_from`` (clamped to ``[held_from,
        num_tokens]``: it never moves back): the blocks wholly before it are unclaimed."""
        new = min(max(held_from, self._held_from), self._num_tokens)
        if self._window is None or new == self._held_from:
            return
        old_first = self._claimed_from(self._held_from, self._num_tokens)
        new_first = self._claimed_from(new, self._num_tokens)
        self._held_from = new
        for block_id in self._blocks[old_first:new_first]:
            self._window.unclaim(block_id)

    def blocks_needed(self, n: int) -> int:
        """How many new blocks appending ``n`` tokens would allocate."""
        if n < 0:
            raise InvalidPositionError(f"cannot append a negative number of tokens ({n})")
        return self._blocks_for_tokens(self._num_tokens + n) - len(self._blocks)

    # --------------------------------------------------------------- mutation
    def append(self, n: int = 1) -> list[int]:
        """Reserve ``n`` more token slots and return the block ids newly allocated for them.

        A block is allocated only when a token crosses a block boundary. Allocation is all or nothing
        (``source.alloc_n``): on ``OutOfBlocksError`` / ``PoolOutOfMemoryError`` the table is unchanged.
        """
        partial = self._num_tokens % self.block_size
        regain = self._window is not None and n > 0 and partial and self._held_from >= self._num_tokens
        new_ids = self.source.alloc_n(self.blocks_needed(n))
        if regain:  # the last block slid out of the window; its new tokens are inside it
            assert self._window is not None
            try:
                self._window.reclaim(self._blocks[-1])
            except BaseException:
                for block_id in new_ids:
                    self.source.free(block_id)
                raise
        self._blocks.extend(new_ids)
        self._num_tokens += n
        return new_ids

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens and free the blocks no longer needed, in row order."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise InvalidPositionError(
                f"cannot truncate to {num_tokens} tokens: the table holds {self._num_tokens}; "
                f"pass a count in [0, {self._num_tokens}]"
            )
        keep = self._blocks_for_tokens(num_tokens)
        if self._window is not None:
            old_first = self._claimed_from(self._held_from, self._num_tokens)
            held = min(self._held_from, num_tokens)
            new_first = self._claimed_from(held, num_tokens)
            for index in range(old_first, len(self._blocks)):
                if not new_first <= index < keep:
                    self._window.unclaim(self._blocks[index])
            self._held_from = held
        tail = self._blocks[keep:]
        del self._blocks[keep:]
        self._num_tokens = num_tokens
        for block_id in tail:
            self.source.free(block_id)

    def share(self, num_tokens: int) -> PageTable:
        """A new table over the same source holding the first ``num_tokens`` tokens: the blocks that hold
        them are shared (one more reference each), nothing is copied. Writing into a shared block is the
        caller's to prevent (copy it first: :meth:`replace`)."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise InvalidPositionError(
                f"cannot share {num_tokens} tokens: the table holds {self._num_tokens}; "
                f"pass a count in [0, {self._num_tokens}]"
            )
        table = PageTable(self.block_size, self.source)
        table._blocks = self._blocks[: self._blocks_for_tokens(num_tokens)]
        table._num_tokens = num_tokens
        for block_id in table._blocks:
            self.source.incref(block_id)
        if self._window is not None:
            table._held_from = min(self._held_from, num_tokens)
            for block_id in table._blocks[table._claimed_from(table._held_from, num_tokens) :]:
                self._window.claim(block_id)
        return table

    def replace(self, index: int, block_id: int) -> int:
        """Put ``block_id`` (already allocated by the caller, so claimed once) at logical block ``index``;
        returns the id it replaces, whose reference the caller still holds and must free (copy-on-write:
        copy, replace, free). The table's window claim moves to the new block, or is dropped where the
        table no longer holds that block for its window."""
        if not 0 <= index < len(self._blocks):
            raise InvalidPositionError(f"logical block {index} is outside [0, {len(self._blocks)})")
        old, self._blocks[index] = self._blocks[index], block_id
        if self._window is not None:
            claimed = index >= self._claimed_from(self._held_from, self._num_tokens)
            self._window.unclaim(old if claimed else block_id)
        return old

    def free_all(self) -> None:
        """Free every block, in row order; the table is then empty and can be reused."""
        self.truncate(0)

    # ---------------------------------------------------------------- lookups
    def locate(self, index: int) -> tuple[int, int]:
        """``(block id, offset)`` of token ``index``.

        Raises :class:`InvalidPositionError` outside ``[0, num_tokens)``.
        """
        if not 0 <= index < self._num_tokens:
            raise InvalidPositionError(
                f"token index {index} is outside the sequence: valid indices are [0, {self._num_tokens})"
            )
        return self._blocks[index // self.block_size], index % self.block_size

    def slot(self, index: int) -> int:
        """Flat slot id of token ``index``: ``block * block_size + offset``."""
        block_id, offset = self.locate(index)
        return block_id * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Flat slot ids of tokens ``[start, end)``; :class:`InvalidPositionError` if out of range."""
        if not 0 <= start <= end <= self._num_tokens:
            raise InvalidPositionError(
                f"token range [{start}, {end}) is outside the sequence: "
                f"need 0 <= start <= end <= {self._num_tokens}"
            )
        bs = self.block_size
        first = start // bs
        out: list[int] = []
        for block_id in self._blocks[first : -(-end // bs)]:  # whole blocks, then trimmed to the range
            out.extend(range(block_id * bs, block_id * bs + bs))
        return out[start - first * bs : end - first * bs]
