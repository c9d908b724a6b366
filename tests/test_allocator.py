"""BlockAllocator: exact ids handed out, FIFO reuse order, all-or-nothing, refcounts, typed errors."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvos.errors import ConfigError, DoubleFreeError, InvalidBlockError, KvosError, OutOfBlocksError
from kvos.memory import BlockAllocator


def test_hands_out_ids_in_order_then_none() -> None:
    a = BlockAllocator(3)
    assert (a.num_blocks, a.num_free, a.num_used) == (3, 3, 0)
    assert [a.alloc(), a.alloc(), a.alloc()] == [0, 1, 2]
    assert a.alloc() is None
    assert (a.num_free, a.num_used) == (0, 3)


def test_freed_ids_come_back_fifo_after_the_never_used_ones() -> None:
    a = BlockAllocator(5)
    assert a.alloc_n(3) == [0, 1, 2]
    assert a.free(2) is True
    assert a.free(0) is True
    assert a.alloc_n(4) == [3, 4, 2, 0]
    a.free(4)
    a.free(1)
    assert [a.alloc(), a.alloc(), a.alloc()] == [4, 1, None]


def test_zero_blocks_and_zero_requests() -> None:
    a = BlockAllocator(0)
    assert a.alloc() is None
    assert a.alloc_n(0) == []
    assert a.can_allocate(0)
    assert not a.can_allocate(1)


def test_alloc_n_is_all_or_nothing_and_names_the_counts() -> None:
    a = BlockAllocator(4)
    assert a.alloc_n(2) == [0, 1]
    a.free(0)
    with pytest.raises(OutOfBlocksError) as info:
        a.alloc_n(4)
    assert (info.value.requested, info.value.free) == (4, 3)
    assert "requested 4" in str(info.value) and "3 free" in str(info.value)
    assert (a.num_free, a.num_used) == (3, 1)
    assert a.alloc_n(3) == [2, 3, 0]  # the queue order is untouched by the failed call


def test_can_allocate_matches_alloc_n() -> None:
    a = BlockAllocator(2)
    assert a.can_allocate(2) and not a.can_allocate(3) and not a.can_allocate(-1)
    a.alloc()
    assert a.can_allocate(1) and not a.can_allocate(2)


def test_negative_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        BlockAllocator(-1)
    with pytest.raises(ConfigError):
        BlockAllocator(2).alloc_n(-1)


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_ids_raise_invalid_block(bad: int) -> None:
    a = BlockAllocator(4)
    a.alloc_n(4)
    for call in (a.free, a.incref, a.refcount):
        with pytest.raises(InvalidBlockError):
            call(bad)
    assert a.num_used == 4


def test_double_free_and_free_of_never_allocated() -> None:
    a = BlockAllocator(3)
    block = a.alloc()
    assert block == 0
    assert a.free(block)
    with pytest.raises(DoubleFreeError):
        a.free(block)
    with pytest.raises(DoubleFreeError):
        a.free(2)  # never handed out
    assert a.num_free == 3
    assert a.alloc_n(3) == [1, 2, 0]  # the failed frees did not re-queue anything


def test_errors_are_typed_kvos_errors() -> None:
    assert issubclass(InvalidBlockError, KvosError) and issubclass(DoubleFreeError, KvosError)
    assert issubclass(OutOfBlocksError, KvosError)


def test_shared_block_returns_only_after_last_free() -> None:
    a = BlockAllocator(3)
    block = a.alloc()
    assert block == 0
    a.incref(block)
    a.incref(block)
    assert a.refcount(block) == 3
    assert a.free(block) is False
    assert a.free(block) is False
    assert a.num_free == 2
    assert a.free(block) is True
    assert a.refcount(block) == 0
    assert a.alloc_n(3) == [1, 2, 0]


def test_incref_of_a_free_block_is_invalid() -> None:
    a = BlockAllocator(2)
    with pytest.raises(InvalidBlockError):
        a.incref(0)
    assert a.refcount(0) == 0 and a.num_free == 2


def test_free_n_checks_everything_first() -> None:
    a = BlockAllocator(4)
    a.alloc_n(3)
    with pytest.raises(InvalidBlockError):
        a.free_n([0, 1, 9])
    with pytest.raises(DoubleFreeError):
        a.free_n([0, 3])
    with pytest.raises(DoubleFreeError):
        a.free_n([2, 2])  # one reference, freed twice
    assert [a.refcount(i) for i in range(4)] == [1, 1, 1, 0]
    a.incref(2)
    a.free_n([2, 1, 2])
    assert a.num_used == 1
    assert a.alloc_n(3) == [3, 1, 2]


def test_grow_appends_new_ids_to_the_back_of_the_queue() -> None:
    a = BlockAllocator(3)
    a.alloc_n(3)
    a.free(1)
    a.grow(5)
    assert (a.num_blocks, a.num_free) == (5, 3)
    assert a.alloc_n(3) == [1, 3, 4]
    a.grow(5)  # same size: no-op
    assert a.num_blocks == 5
    with pytest.raises(ConfigError):
        a.grow(4)


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc / alloc_n / incref / free / free_n / grow against a deque + refcount model."""

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(4)
        self.queue: deque[int] = deque(range(4))
        self.refs: dict[int, int] = {}

    @rule()
    def alloc(self) -> None:
        got = self.a.alloc()
        expected = self.queue.popleft() if self.queue else None
        assert got == expected
        if expected is not None:
            self.refs[expected] = 1

    @rule(n=st.integers(0, 6))
    def alloc_n(self, n: int) -> None:
        if n > len(self.queue):
            with pytest.raises(OutOfBlocksError) as info:
                self.a.alloc_n(n)
            assert (info.value.requested, info.value.free) == (n, len(self.queue))
            return
        expected = [self.queue.popleft() for _ in range(n)]
        assert self.a.alloc_n(n) == expected
        self.refs.update(dict.fromkeys(expected, 1))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.refs)))
        self.a.incref(block)
        self.refs[block] += 1

    @rule(block=st.integers(-1, 12))
    def free(self, block: int) -> None:
        if not 0 <= block < self.a.num_blocks:
            with pytest.raises(InvalidBlockError):
                self.a.free(block)
        elif block not in self.refs:
            with pytest.raises(DoubleFreeError):
                self.a.free(block)
        else:
            self.refs[block] -= 1
            last = self.refs[block] == 0
            assert self.a.free(block) is last
            if last:
                del self.refs[block]
                self.queue.append(block)

    @rule(ids=st.lists(st.integers(0, 11), max_size=4))
    def free_n(self, ids: list[int]) -> None:
        counts = {i: ids.count(i) for i in ids}
        if all(self.refs.get(i, 0) >= c for i, c in counts.items()):
            self.a.free_n(ids)
            for i in ids:
                self.refs[i] -= 1
                if self.refs[i] == 0:
                    del self.refs[i]
                    self.queue.append(i)
        else:
            with pytest.raises((InvalidBlockError, DoubleFreeError)):
                self.a.free_n(ids)

    @rule(extra=st.integers(0, 3))
    def grow(self, extra: int) -> None:
        old = self.a.num_blocks
        self.a.grow(old + extra)
        self.queue.extend(range(old, old + extra))

    @invariant()
    def matches_model(self) -> None:
        assert self.a.num_free == len(self.queue)
        assert self.a.num_used == len(self.refs)
        assert all(self.a.refcount(i) == self.refs.get(i, 0) for i in range(self.a.num_blocks))


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
