"""Window rows: the K/V of a model's sliding-window layers, held only while some sequence's window needs them.

A sliding-window layer (Gemma 3's five of six, a Mistral with ``sliding_window``) attends to the last
``window`` positions only, so once a sequence has moved ``window`` tokens past a block, that layer never
reads the block again. The pool keeps those layers apart: a block id still covers every layer, but a
window layer's K/V of a block live in a *row* of a second, smaller set of slabs, and the row goes back as
soon as no page table still holds the block inside its window (:meth:`PageTable.slide`). A block's global
layers stay as long as the block does.

A page table *claims* the blocks it still holds for its window; the row is released when the last claim
goes (or the block itself is freed). A window layer's slot of a token is ``row * block_size + offset``
(:meth:`WindowRows.slots`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvos.errors import InvalidBlockError

if TYPE_CHECKING:
    from kvos.memory.pool import KVPool

NO_ROW = -1


class WindowRows:
    """Which row of the window layers' slabs each block has, and how many page tables claim it.

    ``pool`` is a :class:`~kvos.memory.pool.KVPool` over the window layers alone, whose block ids are the
    rows; ``num_blocks`` is the owning pool's block count (grown with it by :meth:`grow`).
    """

    def __init__(self, pool: KVPool, num_blocks: int) -> None:
        self.pool = pool
        self._row = [NO_ROW] * num_blocks
        self._claims = [0] * num_blocks
        self.table = torch.full((num_blocks,), NO_ROW, dtype=torch.int64)  # block -> row, for translation

    @property
    def num_used(self) -> int:
        """Rows in use (blocks whose window K/V are held)."""
        return self.pool.allocator.num_used

    def grow(self, num_blocks: int) -> None:
        """Follow the owning pool to ``num_blocks`` block ids."""
        extra = num_blocks - len(self._row)
        self._row.extend([NO_ROW] * extra)
        self._claims.extend([0] * extra)
        self.table = torch.cat((self.table, torch.full((extra,), NO_ROW, dtype=torch.int64)))

    def reset(self, num_blocks: int) -> None:
        """Forget every row (the owning pool shrank back to ``num_blocks`` empty blocks)."""
        self._row = [NO_ROW] * num_blocks
        self._claims = [0] * num_blocks
        self.table = torch.full((num_blocks,), NO_ROW, dtype=torch.int64)
        self.pool.shrink()

    # ------------------------------------------------------------------ rows
    def attach(self, blocks: list[int]) -> None:
        """Give each of ``blocks`` (none with a row) a row and one claim; all or nothing."""
        rows = self.pool.alloc_n(len(blocks))
        for block, row in zip(blocks, rows, strict=True):
            self._row[block], self._claims[block] = row, 1
            self.table[block] = row

    def row(self, block: int) -> int:
        """The row of ``block``, or :data:`NO_ROW` when its window K/V are gone."""
        return self._row[block]

    def claim(self, block: int) -> None:
        """One more page table holds ``block`` inside its window (it must still have its row)."""
        if self._row[block] == NO_ROW:
            raise InvalidBlockError(f"block {block} has no window row to claim")
        self._claims[block] += 1

    def reclaim(self, block: int) -> None:
        """Claim ``block``, giving it a fresh row first if it has none (a table that slid past its last,
        partly filled block writes into it again)."""
        if self._row[block] == NO_ROW:
            self.attach([block])
        else:
            self._claims[block] += 1

    def unclaim(self, block: int) -> None:
        """Drop one claim; the row goes back when none is left."""
        if self._claims[block] > 0:
            self._claims[block] -= 1
        if self._claims[block] == 0:
            self.drop(block)

    def drop(self, block: int) -> None:
        """Release the row of ``block`` (if it has one), whatever claims it had: the block was freed."""
        row = self._row[block]
        if row != NO_ROW:
            self.pool.free(row)
            self._row[block], self._claims[block] = NO_ROW, 0
            self.table[block] = NO_ROW

    # ------------------------------------------------------------ translation
    def slots(self, slots: torch.Tensor, block_size: int) -> torch.Tensor:
        """Block slots -> window slots: int64 ``[n]`` ``block * block_size + offset`` to
        ``row * block_size + offset`` (every block must have its row)."""
        rows = self.table.to(slots.device)[slots // block_size]
        return rows * block_size + slots % block_size

    def locate(self, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block slots (int64 ``[n]``, their blocks with rows or not) -> their window slots and which of them
        are held (bool ``[n]``); a token whose block has no row gets a slot of row 0, to read and ignore."""
        rows = self.table.to(slots.device)[slots // block_size]
        return rows.clamp(min=0) * block_size + slots % block_size, rows >= 0

    def rows(self, blocks: list[int]) -> list[int]:
        """Rows of ``blocks`` (:data:`NO_ROW` where gone)."""
        return [self._row[b] for b in blocks]
