"""A sequence: the tokens whose K/V the pool holds for one stream, with their slots and positions."""

from __future__ import annotations

import torch

from kvos.memory.page_table import PageTable


class Sequence:
    """Token ids, rotary positions and the page table of one stream.

    ``slots`` and ``positions`` are kept as int64 tensors that grow with the sequence, so a decode step
    does not rebuild them from Python lists.
    """

    def __init__(self, page_table: PageTable) -> None:
        self.page_table = page_table
        self.token_ids: list[int] = []
        self._slots = torch.empty(0, dtype=torch.int64)
        self._positions = torch.empty(0, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def slots(self) -> torch.Tensor:
        """int64 [num_tokens] pool slot of every token."""
        return self._slots[: self.num_tokens]

    @property
    def positions(self) -> torch.Tensor:
        """int64 [num_tokens] rotary position of every token."""
        return self._positions[: self.num_tokens]

    def next_position(self) -> int:
        return int(self._positions[self.num_tokens - 1].item()) + 1 if self.token_ids else 0

    def extend(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Reserve pool slots for new tokens; returns their slots, int64 [n]. All or nothing."""
        start = self.num_tokens
        self.page_table.append(len(token_ids))
        new_slots = torch.tensor(self.page_table.slots(start, start + len(token_ids)), dtype=torch.int64)
        self._slots = _put(self._slots, start, new_slots)
        self._positions = _put(self._positions, start, torch.tensor(positions, dtype=torch.int64))
        self.token_ids.extend(token_ids)
        return new_slots

    def truncate(self, num_tokens: int) -> None:
        """Drop every token from ``num_tokens`` on, freeing blocks no longer needed."""
        self.page_table.truncate(num_tokens)
        del self.token_ids[num_tokens:]

    def release(self) -> None:
        """Free every block; the sequence becomes empty."""
        self.page_table.free_all()
        self.token_ids.clear()


def _put(buffer: torch.Tensor, start: int, values: torch.Tensor) -> torch.Tensor:
    """Write values at [start, start + n), doubling the buffer's capacity when it is too small."""
    end = start + values.shape[0]
    if end > buffer.shape[0]:
        grown = torch.empty(max(end, 2 * buffer.shape[0], 64), dtype=buffer.dtype)
        grown[:start] = buffer[:start]
        buffer = grown
    buffer[start:end] = values
    return buffer
