"""A KV pool's head store and the per-head page table: one allocator for every (layer, KV head), compaction
that keeps order and frees the emptied head-blocks, other heads untouched, growth on demand within the
pool's cap, shared with the pool's own blocks."""

from __future__ import annotations

import pytest
import torch

from kvos.errors import InvalidPositionError, PoolOutOfMemoryError
from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.head_store import HeadStore
from kvos.memory.head_table import HeadPageTable
from kvos.memory.page_table import PageTable
from kvos.memory.pool import KVLayout, KVPool

L, HKV, D, BS = 2, 3, 4, 4


def filled(n: int, initial_tokens: int = 64) -> tuple[HeadStore, HeadPageTable, dict]:
    """A pool's head store and a table holding ``n`` tokens in every row; token t of row (l, h) has K =
    value(l, h, t) and V = -K. Returns the per-row values written."""
    pool = KVPool(KVLayout(L, HKV, D, BS), GrowthPolicy(initial_tokens=initial_tokens)).head_store()
    table = HeadPageTable(L, HKV, BS, pool)
    table.append(n)
    values = {}
    for layer in range(L):
        k = torch.stack([torch.arange(HKV) * 10.0 + 100.0 * layer + t for t in range(n)])[..., None]
        k = k.expand(n, HKV, D).contiguous()
        for h in range(HKV):
            pool.put(torch.tensor(table.slots(layer, h, 0, n)), k[:, h], -k[:, h])
        for h in range(HKV):
            values[layer, h] = k[:, h, 0].clone()
    return pool, table, values


def row_keys(pool: HeadStore, table: HeadPageTable, layer: int, h: int) -> torch.Tensor:
    k, v = pool.gather_rows(layer, torch.tensor(table.slots(layer, h, 0, table.num_tokens(layer, h))))
    assert torch.equal(v, -k)
    return k[:, 0]


def test_gather_rows_reads_per_head_slots() -> None:
    pool, table, values = filled(6)
    slots = torch.tensor([table.slots(1, 2, 0, 6)[4], table.slots(0, 1, 0, 6)[0]])
    k, v = pool.gather_rows(0, slots)
    assert torch.equal(k[:, 0], torch.stack([values[1, 2][4], values[0, 1][0]])) and torch.equal(v, -k)


def test_rows_share_one_allocator_and_blocks_are_per_head() -> None:
    pool, table, _ = filled(10)  # 3 blocks of 4 per row, 6 rows
    assert table.num_blocks == 18 and pool.pool.allocator.num_used == 18
    ids = [b for layer in range(L) for h in range(HKV) for b in table.row(layer, h)]
    assert sorted(ids) == list(range(18))  # every head-block is its own; none shared
    assert pool.live_bytes == 18 * pool.bytes_per_block == 18 * 2 * BS * D * 4


def test_dropping_tokens_frees_exact_head_blocks_and_keeps_order() -> None:
    pool, table, values = filled(10)
    others = {row: row_keys(pool, table, *row) for row in values if row != (1, 2)}
    before_free = pool.pool.allocator.num_free
    keep = [0, 1, 5, 9]  # 10 tokens in 3 blocks -> 4 tokens in 1 block: 2 freed
    tail = table.row(1, 2)[1:]
    moves, freed = table.drop(1, 2, keep)
    pool.move(moves)
    assert freed == tail
    assert pool.pool.allocator.num_free == before_free + 2
    assert all(pool.pool.allocator.refcount(b) == 0 for b in tail) and len(table.row(1, 2)) == 1
    assert torch.equal(row_keys(pool, table, 1, 2), values[1, 2][keep])
    for row, keys in others.items():  # every other head: same tokens, same bytes
        assert torch.equal(row_keys(pool, table, *row), keys)
        assert table.num_tokens(*row) == 10


def test_a_freed_head_block_is_reused_by_another_head() -> None:
    pool, table, _ = filled(8, initial_tokens=12 * BS)  # 12 blocks exactly: 6 rows x 2
    assert pool.pool.allocator.num_free == 0
    freed_id = table.row(0, 1)[1]
    moves, _ = table.drop(0, 1, [0, 2, 3])
    pool.move(moves)
    assert pool.pool.allocator.num_free == 1
    other = HeadPageTable(1, 1, BS, pool)
    other.append(1)
    assert other.row(0, 0) == [freed_id] and pool.pool.num_blocks == 12  # reused, no growth


def test_appending_grows_the_pool_and_keeps_data() -> None:
    pool, table, values = filled(6, initial_tokens=BS)
    assert pool.pool.resizes >= 1 and pool.pool.num_blocks >= 12
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
    used = pool.pool.allocator.num_used
    table.free_all()
    assert pool.pool.allocator.num_used == used - 12 == 0


def test_append_is_all_or_nothing() -> None:
    table = HeadPageTable(2, 2, 4, BlockAllocator(5))
    table.append(4)  # 4 rows x 1 block
    with pytest.raises(MemoryError):
        table.append(1)  # needs 4 more blocks, 1 free
    assert [table.num_tokens(layer, h) for layer in range(2) for h in range(2)] == [4, 4, 4, 4]
    assert table.num_blocks == 4


def test_head_blocks_count_against_the_pool_cap_with_its_blocks() -> None:
    """One cap for both kinds: the pool's blocks and the head store's head-blocks, each growing into what
    the other leaves; a head-block given back makes room for either kind."""
    lay = KVLayout(L, HKV, D, BS)
    per_block = lay.bytes_per_block  # 2 * L * HKV * D * 4 * BS = 768: 6 head-blocks' worth
    cap = 4 * per_block
    pool = KVPool(lay, GrowthPolicy(initial_tokens=BS, max_bytes=cap))
    full = PageTable(BS, pool)
    full.append(2 * BS)  # 2 blocks of every layer and head: half the cap
    store = pool.head_store()
    heads = HeadPageTable(L, HKV, BS, store)
    heads.append(2 * BS)  # 2 head-blocks per (layer, head): 12, two blocks of bytes more
    assert pool.live_bytes == 2 * per_block + 12 * store.bytes_per_block == cap
    assert pool.head_live_bytes == 2 * per_block and pool.nbytes <= cap
    with pytest.raises(PoolOutOfMemoryError):
        full.append(1)  # a third block does not fit beside the head-blocks
    with pytest.raises(PoolOutOfMemoryError):
        heads.append(1)  # nor one more token per head
    assert full.num_tokens == 2 * BS and heads.total_tokens == L * HKV * 2 * BS  # nothing changed
    for layer in range(L):
        for h in range(HKV):
            heads.truncate(layer, h, BS)  # every head gives a head-block back: one block's worth
    assert pool.head_live_bytes == per_block
    with pytest.raises(PoolOutOfMemoryError):
        full.append(1)  # the head store's slabs keep their size while it holds head-blocks
    heads.append(BS)  # the head-blocks given back are taken again, without growing
    assert pool.head_live_bytes == 2 * per_block and pool.nbytes <= cap
    heads.free_all()
    full.append(BS)  # an empty head store gives its slabs back to the pool's blocks
    assert full.num_tokens == 3 * BS and pool.nbytes <= cap and pool.head_live_bytes == 0


def test_the_head_store_reads_back_what_each_head_wrote_and_refuses_a_bad_layer() -> None:
    store, table, values = filled(5)
    slots = torch.tensor([table.slots(1, h, 0, 5) for h in range(HKV)])
    k, v = store.gather(1, slots)
    assert k.shape == (HKV, 5, D) and torch.equal(v, -k)
    assert all(torch.equal(k[h, :, 0], values[1, h]) for h in range(HKV))
    with pytest.raises(ValueError, match="layer 2 is out of range"):
        store.gather(L, slots)
