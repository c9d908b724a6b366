"""Segments and sequences: the slots and positions a run of tokens holds in the pool."""

from __future__ import annotations

import torch

from kvos.engine.sequence import Sequence
from kvos.memory.page_table import PageTable
from kvos.memory.pool import KVLayout, KVPool


def test_slots_of_long_and_short_appends_are_the_page_tables() -> None:
    """Segments hold exactly the page table's slots, across interleaved sequences (so the blocks are not
    consecutive) and appends of any length that start mid-block."""
    pool = KVPool(KVLayout(1, 1, 4, block_size=4))
    a, b = (Sequence(lambda: PageTable(4, pool)) for _ in range(2))
    sizes = [3, 37, 1, 2, 32, 7, 65, 0, 4]
    for i, n in enumerate(sizes):
        for seq in (a, b):
            start = seq.num_tokens
            slots = seq.extend([0] * n, range(start, start + n))
            table = seq.segments[-1].page_table
            assert slots.tolist() == table.slots(start, start + n), (i, n)
    assert torch.equal(a.slots, torch.tensor(a.segments[-1].page_table.slots(0, a.num_tokens)))
    assert set(a.slots.tolist()).isdisjoint(b.slots.tolist())
