"""Segments and sequences: the slots and positions a run of tokens holds in the pool."""

from __future__ import annotations

import random
from typing import Any

import pytest
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


def _state(seq: Sequence) -> tuple[list[int], list[int], list[int], list[list[int]], list[list[int]]]:
    return (
        seq.token_ids,
        seq.slots.tolist(),
        seq.positions.tolist(),
        [s.slots.tolist() for s in seq.segments],
        [s.positions.tolist() for s in seq.segments],
    )


@pytest.mark.parametrize("seed", range(8))
def test_one_token_appends_equal_the_general_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoded token takes the one-token path (ints written through numpy views); driven by the same
    random appends, new segments, truncations, removals and re-insertions, a sequence on that path and one
    forced onto the general path hold the same tokens, slots and positions, and return the same slots."""
    rng = random.Random(seed)
    ops: list[tuple[str, int]] = []
    for _ in range(300):
        kind = rng.choices(["one", "many", "open", "drop", "move"], weights=[70, 8, 6, 8, 8])[0]
        ops.append((kind, rng.randrange(1, 40)))

    def run(general: bool) -> tuple[list[list[int]], Any, int]:
        pool = KVPool(KVLayout(1, 1, 4, block_size=4))
        seq, other = (Sequence(lambda: PageTable(4, pool)) for _ in range(2))
        returned, taken = [], 0
        real = Sequence._append_one

        def counted(self: Sequence, token_id: int, position: int) -> torch.Tensor:
            nonlocal taken
            taken += self is seq
            return real(self, token_id, position)

        with monkeypatch.context() as m:
            m.setattr(Sequence, "_append_one", counted)
            if general:
                m.setattr(Sequence, "_can_append_one", lambda self: False)
            for kind, n in ops:
                if kind == "one":
                    start = seq.next_position() + (n if n > 35 else 0)  # sometimes a gap in positions
                    returned.append(seq.extend([n], [start]).tolist())
                elif kind == "many":
                    start = seq.next_position()
                    returned.append(seq.extend(list(range(n)), range(start, start + n)).tolist())
                elif kind == "open":
                    seq.open_segment()
                elif kind == "drop" and seq.segments and seq.segments[-1].num_tokens:
                    seq.drop_last(min(n, seq.segments[-1].num_tokens))
                elif kind == "move" and len(seq.segments) > 1:
                    seg = seq.segments[n % (len(seq.segments) - 1)]
                    seq.remove(seg)
                    seq.insert(len(seq.segments), seg)  # the last segment is now an older one
                other.extend([1], [other.next_position()])  # interleaved: blocks not consecutive
                for seg in seq.segments:  # the numpy view's first position is the tensor's
                    assert not seg.num_tokens or seg.first_position == int(seg.positions[0])
        return returned, _state(seq), taken

    fast, general = run(False), run(True)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert fast[2] > 100 and general[2] == 0  # most single tokens took the one-token path
