"""PageTable: blocks only at boundaries, exact (block, offset) and slots, unchanged on failure, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvos.errors import ConfigError, InvalidPositionError, OutOfBlocksError
from kvos.memory import BlockAllocator, BlockSource, PageTable


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ConfigError):
        PageTable(block_size, BlockAllocator(4))


def test_append_allocates_only_when_crossing_a_block_boundary() -> None:
    a = BlockAllocator(4)
    t = PageTable(4, a)
    assert t.blocks_needed(1) == 1
    assert t.append() == [0]
    for _ in range(3):
        assert t.blocks_needed(1) == 0
        assert t.append() == []
    assert (t.num_tokens, t.num_blocks, a.num_used) == (4, 1, 1)
    assert t.append() == [1]
    assert (t.num_tokens, t.blocks) == (5, [0, 1])


def test_append_many_and_zero() -> None:
    t = PageTable(4, BlockAllocator(8))
    assert t.append(0) == []
    assert t.blocks_needed(9) == 3
    assert t.append(9) == [0, 1, 2]
    assert t.blocks_needed(3) == 0 and t.blocks_needed(4) == 1
    assert t.append(3) == []
    assert t.append(5) == [3, 4]
    assert t.num_tokens == 17
    with pytest.raises(InvalidPositionError):
        t.append(-1)


def _interleaved() -> tuple[BlockAllocator, PageTable, PageTable]:
    """Two tables sharing an allocator: t1 holds blocks [0, 2], t2 holds [1]."""
    a = BlockAllocator(8)
    t1, t2 = PageTable(4, a), PageTable(4, a)
    t1.append(4)
    t2.append(3)
    t1.append(2)
    return a, t1, t2


def test_locate_and_slots_follow_the_block_row() -> None:
    _, t1, t2 = _interleaved()
    assert t1.blocks == [0, 2] and t2.blocks == [1]
    assert [t1.locate(i) for i in range(6)] == [(0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1)]
    assert [t1.slot(i) for i in range(6)] == [0, 1, 2, 3, 8, 9]
    assert t1.slots(2, 6) == [2, 3, 8, 9]
    assert t1.slots(3, 3) == []
    assert t2.slots(0, 3) == [4, 5, 6]
    assert t1.slots(0, 6) == [0, 1, 2, 3, 8, 9] and t1.slots(4, 5) == [8]


def test_row_is_the_shared_row_for_every_head_and_a_copy() -> None:
    _, t1, _ = _interleaved()
    assert t1.row(0, 0) == t1.row(5, 3) == t1.blocks == [0, 2]
    t1.row(0, 0).append(99)
    t1.blocks.append(99)
    assert t1.blocks == [0, 2]
    with pytest.raises(InvalidPositionError):
        t1.row(-1, 0)


@pytest.mark.parametrize("index", [-1, 6, 100])
def test_invalid_positions(index: int) -> None:
    _, t1, _ = _interleaved()
    with pytest.raises(InvalidPositionError):
        t1.locate(index)
    with pytest.raises(InvalidPositionError):
        t1.slot(index)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (0, 7), (4, 3)])
def test_invalid_slot_ranges(start: int, end: int) -> None:
    _, t1, _ = _interleaved()
    with pytest.raises(InvalidPositionError):
        t1.slots(start, end)


def test_empty_table_has_no_positions() -> None:
    t = PageTable(4, BlockAllocator(1))
    with pytest.raises(InvalidPositionError):
        t.locate(0)
    assert t.slots(0, 0) == []


def test_out_of_blocks_leaves_table_and_allocator_unchanged() -> None:
    a = BlockAllocator(3)
    other = PageTable(4, a)
    other.append(1)
    t = PageTable(4, a)
    t.append(3)
    with pytest.raises(OutOfBlocksError) as info:
        t.append(6)  # needs 2 more blocks, 1 free
    assert (info.value.requested, info.value.free) == (2, 1)
    assert (t.num_tokens, t.blocks, a.num_free) == (3, [1], 1)
    assert t.append(5) == [2]
    with pytest.raises(OutOfBlocksError):
        t.append(1)
    assert (t.num_tokens, t.blocks, a.num_free) == (8, [1, 2], 0)


def test_truncate_frees_exactly_the_tail_blocks() -> None:
    a = BlockAllocator(6)
    t = PageTable(4, a)
    t.append(14)  # blocks 0, 1, 2, 3
    t.truncate(14)
    assert t.blocks == [0, 1, 2, 3]
    t.truncate(9)
    assert (t.num_tokens, t.blocks) == (9, [0, 1, 2])
    assert [a.refcount(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    t.truncate(5)
    assert t.blocks == [0, 1]
    assert a.alloc_n(4) == [4, 5, 3, 2]  # freed tail blocks joined the back of the queue, in row order
    with pytest.raises(InvalidPositionError):
        t.truncate(6)
    with pytest.raises(InvalidPositionError):
        t.truncate(-1)
    assert t.num_tokens == 5


def test_free_all_returns_every_block_and_table_is_reusable() -> None:
    a = BlockAllocator(5)
    t1, t2 = PageTable(2, a), PageTable(2, a)
    t1.append(3)
    t2.append(4)
    t1.append(2)
    t1.free_all()
    assert (t1.num_tokens, t1.num_blocks, a.num_free) == (0, 0, 3)
    t2.free_all()
    assert a.num_free == a.num_blocks == 5
    assert t1.append(10) == [0, 1, 4, 2, 3]  # t1's row, then t2's row, in the order they were freed
    assert a.num_free == 0


def test_allocator_is_a_block_source() -> None:
    source: BlockSource = BlockAllocator(1)
    assert PageTable(1, source).append() == [0]


class PageTableMachine(RuleBasedStateMachine):
    """Several tables on one small allocator: blocks disjoint, counts exact, nothing leaks."""

    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(10)
        self.live: list[PageTable] = []

    @rule(target=tables, block_size=st.integers(1, 4))
    def new_table(self, block_size: int) -> PageTable:
        t = PageTable(block_size, self.a)
        self.live.append(t)
        return t

    @rule(t=tables, n=st.integers(0, 9))
    def append(self, t: PageTable, n: int) -> None:
        before = (t.num_tokens, t.blocks, self.a.num_free)
        needed = t.blocks_needed(n)
        if needed > self.a.num_free:
            with pytest.raises(OutOfBlocksError):
                t.append(n)
            assert (t.num_tokens, t.blocks, self.a.num_free) == before
            return
        new = t.append(n)
        assert len(new) == needed
        assert t.blocks == before[1] + new
        assert t.num_tokens == before[0] + n

    @rule(t=tables, data=st.data())
    def truncate(self, t: PageTable, data: st.DataObject) -> None:
        keep = data.draw(st.integers(0, t.num_tokens))
        before = t.blocks
        t.truncate(keep)
        assert t.blocks == before[: t.num_blocks]
        assert all(self.a.refcount(b) == 0 for b in before[t.num_blocks :])

    @rule(t=consumes(tables))
    def free_all(self, t: PageTable) -> None:
        t.free_all()
        assert (t.num_tokens, t.num_blocks) == (0, 0)
        self.live.remove(t)

    @invariant()
    def blocks_are_disjoint_and_counted(self) -> None:
        held = [b for t in self.live for b in t.blocks]
        assert len(held) == len(set(held)) == self.a.num_used
        for t in self.live:
            assert t.num_blocks == -(-t.num_tokens // t.block_size)
            slots = t.slots(0, t.num_tokens)
            assert len(set(slots)) == t.num_tokens
            assert all(s // t.block_size in t.blocks for s in slots)

    def teardown(self) -> None:
        for t in self.live:
            t.free_all()
        assert self.a.num_free == self.a.num_blocks


PageTableMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPageTableMachine = PageTableMachine.TestCase
