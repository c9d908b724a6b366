"""Head pool and per-head page table: one allocator for every (layer, KV head), compaction that keeps order
and frees the emptied head-blocks, other heads untouched, growth on demand."""

from __future__ import annotations

import pytest
import torch

from kvos.errors import InvalidPositionError
from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.head_pool import HeadLayout, HeadPool, drop_tokens
from kvos.memory.head_table import HeadPageTable

L, HKV, D, BS = 2, 3, 4, 4


def filled(n: int, initial_tokens: int = 64) -> tuple[HeadPool, HeadPageTable, dict]:
    """A pool and a table holding ``n`` tokens in every row; token t of row (l, h) has K = value(l, h, t)
    and V = -K. Returns the per-row values written."""
    pool = HeadPool(HeadLayout(L, HKV, D, BS), GrowthPolicy(initial_tokens=initial_tokens))
    table = pool.new_table()
    table.append(n)
    values = {}
    for layer in range(L):
        k = torch.stack([torch.arange(HKV) * 10.0 + 100.0 * layer + t for t in range(n)])[..., None]
        k = k.expand(n, HKV, D).contiguous()
        slots = torch.tensor([table.slots(layer, h, 0, n) for h in range(HKV)])
        pool.write(layer, slots, k, -k)
        for h in range(HKV):
            values[layer, h] = k[:, h, 0].clone()
    return pool, table, values


def row_keys(pool: HeadPool, table: HeadPageTable, layer: int, h: int) -> torch.Tensor:
    k, v = pool.read_slots(table.slots(layer, h, 0, table.num_tokens(layer, h)))
    assert torch.equal(v, -k)
    return k[:, 0]


def test_gather_rows_reads_per_head_slots() -> None:
    pool, table, values = filled(6)
    slots = torch.tensor([table.slots(1, 2, 0, 6)[4], table.slots(0, 1, 0, 6)[0]])
    k, v = pool.gather_rows(0, slots)
    assert torch.equal(k[:, 0], torch.stack([values[1, 2][4], values[0, 1][0]])) and torch.equal(v, -k)


def test_rows_share_one_allocator_and_blocks_are_per_head() -> None:
    pool, table, _ = filled(10)  # 3 blocks of 4 per row, 6 rows
    assert table.num_blocks == 18 and pool.allocator.num_used == 18
    ids = [b for layer in range(L) for h in range(HKV) for b in table.row(layer, h)]
    assert sorted(ids) == list(range(18))  # every head-block is its own; none shared
    assert pool.resident_bytes == 18 * pool.layout.bytes_per_head_block == 18 * 2 * BS * D * 4


def test_dropping_tokens_frees_exact_head_blocks_and_keeps_order() -> None:
    pool, table, values = filled(10)
    others = {row: row_keys(pool, table, *row) for row in values if row != (1, 2)}
    before_free = pool.allocator.num_free
    keep = [0, 1, 5, 9]  # 10 tokens in 3 blocks -> 4 tokens in 1 block: 2 freed
    tail = table.row(1, 2)[1:]
    assert drop_tokens(pool, table, 1, 2, keep) == 2
    assert pool.allocator.num_free == before_free + 2
    assert all(pool.allocator.refcount(b) == 0 for b in tail) and len(table.row(1, 2)) == 1
    assert torch.equal(row_keys(pool, table, 1, 2), values[1, 2][keep])
    for row, keys in others.items():  # every other head: same tokens, same bytes
        assert torch.equal(row_keys(pool, table, *row), keys)
        assert table.num_tokens(*row) == 10


def test_a_freed_head_block_is_reused_by_another_head() -> None:
    pool, table, _ = filled(8, initial_tokens=12 * BS)  # 12 blocks exactly: 6 rows x 2
    assert pool.allocator.num_free == 0
    freed_id = table.row(0, 1)[1]
    drop_tokens(pool, table, 0, 1, [0, 2, 3])
    assert pool.allocator.num_free == 1
    other = HeadPageTable(1, 1, BS, pool)
    other.append(1)
    assert other.row(0, 0) == [freed_id] and pool.num_blocks == 12  # reused, no growth


def test_appending_grows_the_pool_and_keeps_data() -> None:
    pool, table, values = filled(6, initial_tokens=BS)
    assert pool.resizes >= 1 and pool.num_blocks >= 12
    for row, keys in values.items():
        assert torch.equal(row_keys(pool, table, *row), keys)


def test_drop_rejects_bad_indices_and_truncate_frees() -> None:
    pool, table, _ = filled(6)
    with pytest.raises(InvalidPositionError):
        table.drop(0, 0, [2, 1])
    with pytest.raises(InvalidPositionError):
        table.drop(0, 0, [0, 6])
    with pytest.raises(InvalidPositionError):
        table.num_tokens(2, 0)
    used = pool.allocator.num_used
    table.free_all()
    assert pool.allocator.num_used == used - 12 == 0


def test_append_is_all_or_nothing() -> None:
    table = HeadPageTable(2, 2, 4, BlockAllocator(5))
    table.append(4)  # 4 rows x 1 block
    with pytest.raises(MemoryError):
        table.append(1)  # needs 4 more blocks, 1 free
    assert [table.num_tokens(layer, h) for layer in range(2) for h in range(2)] == [4, 4, 4, 4]
    assert table.num_blocks == 4
