"""Per-head page table: each (layer, KV head) of a sequence maps its own tokens to its own head-blocks.

Plain Python bookkeeping, no torch. A head-block holds K and V of one KV head of one layer for
``block_size`` tokens (see :mod:`kvos.memory.head_store`, a KV pool's part for them); the blocks come from one
:class:`~kvos.memory.page_table.BlockSource` shared by every layer and head, so a block one head frees can
be reused by any other.

Row ``(layer, kv_head)`` lists the head-block ids of that head's tokens. The head's ``i``-th held token
lives at flat slot ``row[i // block_size] * block_size + i % block_size``. Tokens are kept in arrival
order; dropping some compacts the row (the survivors move down, keeping their order) and the blocks
emptied at the tail go back to the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.page_table import BlockSource

Move = tuple[int, int]  # (source slot, destination slot)


class HeadPageTable:
    """Rows of head-block ids, one per (layer, KV head), over one shared block source."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, source: BlockSource) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if block_size <= 0:
            raise ConfigError(f"block_size must be a positive number of tokens, got {block_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.source = source
        self._rows: list[list[int]] = [[] for _ in range(num_layers * num_kv_heads)]
        self._counts: list[int] = [0] * (num_layers * num_kv_heads)

    # ------------------------------------------------------------------ sizes
    def _index(self, layer: int, kv_head: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= kv_head < self.num_kv_heads):
            raise InvalidPositionError(
                f"(layer, kv_head) = ({layer}, {kv_head}) is out of range: "
                f"the table has {self.num_layers} layers and {self.num_kv_heads} KV heads"
            )
        return layer * self.num_kv_heads + kv_head

    def num_tokens(self, layer: int, kv_head: int) -> int:
        """Tokens held by ``(layer, kv_head)``."""
        return self._counts[self._index(layer, kv_head)]

    def row(self, layer: int, kv_head: int) -> list[int]:
        """A copy of the head-block ids of ``(layer, kv_head)``, in token order."""
        return list(self._rows[self._index(layer, kv_head)])

    @property
    def num_blocks(self) -> int:
        """Head-blocks held over all rows."""
        return sum(len(r) for r in self._rows)

    @property
    def total_tokens(self) -> int:
        """Tokens held over all rows (a token kept by two heads counts twice)."""
        return sum(self._counts)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --------------------------------------------------------------- mutation
    def append(self, n: int) -> None:
        """Reserve ``n`` more token slots in every row, all or nothing (one ``alloc_n`` for all rows)."""
        if n < 0:
            raise InvalidPositionError(f"cannot append a negative number of tokens ({n})")
        self.append_rows([n] * len(self._rows))

    def append_rows(self, counts: Sequence[int]) -> None:
        """Reserve ``counts[i]`` more token slots in row ``i`` (layer-major: ``layer * num_kv_heads +
        kv_head``), all or nothing (one ``alloc_n`` for all rows)."""
        if len(counts) != len(self._rows) or any(n < 0 for n in counts):
            raise InvalidPositionError(
                f"append_rows takes {len(self._rows)} counts >= 0, one per (layer, KV head), "
                f"got {list(counts)}"
            )
        needs = [
            self._blocks_for(c + n) - len(r) for c, n, r in zip(self._counts, counts, self._rows, strict=True)
        ]
        ids = self.source.alloc_n(sum(needs))
        start = 0
        for i, need in enumerate(needs):
            self._rows[i].extend(ids[start : start + need])
            self._counts[i] += counts[i]
            start += need

    def truncate(self, layer: int, kv_head: int, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` tokens of one row; free and return the head-blocks emptied."""
        i = self._index(layer, kv_head)
        if not 0 <= num_tokens <= self._counts[i]:
            raise InvalidPositionError(
                f"cannot truncate row ({layer}, {kv_head}) to {num_tokens} tokens: it holds {self._counts[i]}"
            )
        keep = self._blocks_for(num_tokens)
        tail = self._rows[i][keep:]
        del self._rows[i][keep:]
        self._counts[i] = num_tokens
        for block_id in tail:
            self.source.free(block_id)
        return tail

    def drop(self, layer: int, kv_head: int, keep: Sequence[int]) -> tuple[list[Move], list[int]]:
        """Keep only the tokens at row indices ``keep`` (strictly increasing) of ``(layer, kv_head)``.

        Survivor ``keep[j]`` moves to index ``j``. Returns the slot moves the caller must apply to the
        K/V tensors (only those whose slot changes, in increasing destination order, so applying them
        all at once from a gathered copy is safe) and the head-block ids freed.
        """
        i = self._index(layer, kv_head)
        count = self._counts[i]
        for a, b in pairwise(keep):
            if b <= a:
                raise InvalidPositionError(f"keep indices must be strictly increasing, got {list(keep)}")
        if keep and (keep[0] < 0 or keep[-1] >= count):
            raise InvalidPositionError(f"keep indices must lie in [0, {count}), got {list(keep)}")
        first = next((dst for dst, src in enumerate(keep) if src != dst), len(keep))  # the prefix stays
        moves = [(self._slot(i, keep[dst]), self._slot(i, dst)) for dst in range(first, len(keep))]
        return moves, self.truncate(layer, kv_head, len(keep))

    def share(self, counts: Sequence[int]) -> HeadPageTable:
        """A new table over the same source whose row ``i`` holds the first ``counts[i]`` tokens of this
        one's: the head-blocks that hold them are shared (one more reference each), nothing is copied.
        Writing into a shared head-block is the caller's to prevent (copy it first: :meth:`replace`)."""
        if len(counts) != len(self._rows) or any(
            not 0 <= n <= c for n, c in zip(counts, self._counts, strict=True)
        ):
            raise InvalidPositionError(f"share takes {len(self._rows)} counts, each within its row's tokens")
        table = HeadPageTable(self.num_layers, self.num_kv_heads, self.block_size, self.source)
        for i, n in enumerate(counts):
            table._rows[i] = self._rows[i][: self._blocks_for(n)]
            table._counts[i] = n
            for block_id in table._rows[i]:
                self.source.incref(block_id)
        return table

    def replace(self, layer: int, kv_head: int, index: int, block_id: int) -> int:
        """Put ``block_id`` (a copy the caller made) at logical head-block ``index`` of one row; returns the
        id it replaced, whose reference the caller drops."""
        row = self._rows[self._index(layer, kv_head)]
        old, row[index] = row[index], block_id
        return old

    def free_all(self) -> None:
        """Free every row's head-blocks; the table is then empty."""
        for layer in range(self.num_layers):
            for kv_head in range(self.num_kv_heads):
                self.truncate(layer, kv_head, 0)

    # ---------------------------------------------------------------- lookups
    def _slot(self, i: int, index: int) -> int:
        bs = self.block_size
        return self._rows[i][index // bs] * bs + index % bs

    def slots(self, layer: int, kv_head: int, start: int, end: int) -> list[int]:
        """Flat slot ids of tokens ``[start, end)`` of one row."""
        i = self._index(layer, kv_head)
        if not 0 <= start <= end <= self._counts[i]:
            raise InvalidPositionError(
                f"token range [{start}, {end}) is outside row ({layer}, {kv_head}), "
                f"which holds {self._counts[i]} tokens"
            )
        return [self._slot(i, t) for t in range(start, end)]
