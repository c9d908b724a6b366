"""GrowthPolicy sizes; KVPool: growth keeps data bit-identical, stays under the cap, round-trips."""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvos.errors import ConfigError, InvalidBlockError, PoolOutOfMemoryError
from kvos.memory import BlockSource, GrowthPolicy, KVLayout, KVPool, PageTable

KIB = 1024

# ---------------------------------------------------------------- growth policy


def _sequence(policy: GrowthPolicy, block_size: int, bpb: int, steps: int) -> list[int]:
    sizes = [policy.initial_blocks(block_size, bpb)]
    for _ in range(steps):
        sizes.append(policy.next_blocks(sizes[-1], block_size, bpb))
    return sizes


def test_growth_doubles_while_small_then_never_more_than_doubles() -> None:
    # 1 GiB is far more than this pool: above 4096 tokens a step still only doubles it.
    assert _sequence(GrowthPolicy(), 16, KIB, 6) == [16, 32, 64, 128, 256, 512, 1024]


def test_growth_adds_step_bytes_once_large() -> None:
    # 8 MiB per block (a 7B fp16 model at block 16): 1 GiB is 128 blocks per step above 4096 tokens.
    assert _sequence(GrowthPolicy(), 16, 8 << 20, 6) == [16, 32, 64, 128, 256, 384, 512]
    small_step = GrowthPolicy(step_bytes=64 * KIB)
    assert _sequence(small_step, 16, KIB, 6) == [16, 32, 64, 128, 256, 320, 384]
    tiny_step = GrowthPolicy(step_bytes=1)  # less than a block: at least one block per step
    assert tiny_step.next_blocks(256, 16, KIB) == 257


def test_growth_stops_at_the_cap() -> None:
    capped = GrowthPolicy(max_bytes=300 * KIB)
    assert _sequence(capped, 16, KIB, 6) == [16, 32, 64, 128, 256, 300, 300]
    assert GrowthPolicy(initial_tokens=256, max_bytes=10 * KIB).initial_blocks(16, KIB) == 10
    assert GrowthPolicy(max_bytes=KIB - 1).initial_blocks(16, KIB) == 0
    assert GrowthPolicy(max_bytes=0).next_blocks(0, 16, KIB) == 0


def test_initial_blocks_round_up_and_grow_from_zero() -> None:
    assert GrowthPolicy(initial_tokens=17).initial_blocks(16, KIB) == 2
    assert GrowthPolicy().next_blocks(0, 16, KIB) == 1


def test_blocks_for_is_one_target_or_a_typed_error() -> None:
    policy = GrowthPolicy(max_bytes=300 * KIB)
    assert policy.blocks_for(16, 16, 16, KIB) == 16
    assert policy.blocks_for(16, 100, 16, KIB) == 128
    assert policy.blocks_for(16, 290, 16, KIB) == 300
    with pytest.raises(PoolOutOfMemoryError) as info:
        policy.blocks_for(16, 301, 16, KIB)
    err = info.value
    assert (err.needed_bytes, err.max_bytes, err.pool_bytes) == (301 * KIB, 300 * KIB, 16 * KIB)


@given(
    current=st.integers(0, 5000),
    needed=st.integers(0, 20000),
    step_blocks=st.integers(1, 3000),
    cap_blocks=st.none() | st.integers(0, 20000),
)
@settings(max_examples=200, deadline=None)
def test_blocks_for_reaches_need_within_twice_and_cap(
    current: int, needed: int, step_blocks: int, cap_blocks: int | None
) -> None:
    bpb = 64
    policy = GrowthPolicy(
        step_bytes=step_blocks * bpb, max_bytes=None if cap_blocks is None else cap_blocks * bpb + 7
    )
    if cap_blocks is not None and needed > max(cap_blocks, current):
        with pytest.raises(PoolOutOfMemoryError):
            policy.blocks_for(current, needed, 16, bpb)
        return
    target = policy.blocks_for(current, needed, 16, bpb)
    if needed <= current:
        assert target == current
    else:
        assert needed <= target <= max(1, 2 * (needed - 1))
        assert cap_blocks is None or target <= cap_blocks


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_tokens": 0},
        {"double_below_tokens": -1},
        {"step_bytes": 0},
        {"max_bytes": -1},
    ],
)
def test_growth_policy_validates(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        GrowthPolicy(**kwargs)


def test_growth_policy_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        GrowthPolicy().next_blocks(4, 0, KIB)
    with pytest.raises(ConfigError):
        GrowthPolicy().initial_blocks(16, 0)


# ----------------------------------------------------------------------- layout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=3, block_size=4)
BPB = LAYOUT.bytes_per_block  # 2 (K, V) * 2 layers * 2 heads * 3 dims * 4 bytes * 4 tokens = 384


def _small_policy(max_blocks: int | None = 20) -> GrowthPolicy:
    return GrowthPolicy(
        initial_tokens=8,
        double_below_tokens=32,
        step_bytes=3 * BPB,
        max_bytes=None if max_blocks is None else max_blocks * BPB,
    )


def test_layout_sizes() -> None:
    assert LAYOUT.bytes_per_token == 96
    assert BPB == 384
    half = KVLayout(32, 8, 128, block_size=16, dtype=torch.bfloat16)
    assert half.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert half.bytes_per_block == half.bytes_per_token * 16


def test_layout_accepts_a_device_string_and_validates() -> None:
    assert KVLayout(1, 1, 1, device="cpu").device == torch.device("cpu")  # type: ignore[arg-type]
    for bad in ((0, 1, 1), (1, 1, -2), (1, 0, 1)):
        with pytest.raises(ConfigError):
            KVLayout(*bad)
    with pytest.raises(ConfigError):
        KVLayout(1, 1, 1, block_size=0)
    with pytest.raises(ConfigError):
        KVLayout(1, 1, 1, dtype=torch.int32)


def _tensor_bytes(pool: KVPool) -> int:
    return sum(t.numel() * t.element_size() for t in pool.k + pool.v)


def test_pool_starts_at_the_initial_size() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    assert pool.num_blocks == 2
    assert pool.k[0].shape == (2, 4, 2, 3) and len(pool.k) == len(pool.v) == 2
    assert pool.nbytes == _tensor_bytes(pool) == 2 * BPB
    assert (pool.live_bytes, pool.resizes, pool.copy_seconds) == (0, 0, 0.0)
    default = KVPool(LAYOUT)
    assert default.num_blocks == 64  # 256 tokens / 4


def _fill(pool: KVPool, ids: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, len(ids), *LAYOUT.block_shape(1)[1:])
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    pool.write_blocks(ids, k, v)
    return k, v


def test_alloc_grows_once_to_the_policy_target_and_keeps_data() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    first = pool.alloc_n(2)
    k, v = _fill(pool, first, 0)
    assert pool.alloc_n(5) == [2, 3, 4, 5, 6]  # 2 -> 4 -> 8 blocks: one resize
    assert (pool.num_blocks, pool.resizes, pool.allocator.num_free) == (8, 1, 1)
    assert pool.copy_seconds > 0.0
    assert pool.nbytes == _tensor_bytes(pool) == 8 * BPB
    assert pool.live_bytes == 7 * BPB
    k2, v2 = pool.read_blocks(first)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert pool.alloc() == 7
    assert pool.alloc() == 8  # 8 blocks = 32 tokens: past double_below, add 3 blocks
    assert pool.num_blocks == 11


def test_growth_in_place_copies_nothing_and_keeps_every_block() -> None:
    """On the CPU a layer tensor is the first blocks of a range reserved for the pool's most: growing it
    is a longer view of the same memory (same address, the blocks written before unchanged, the new ones
    zero), the cap's blocks at most."""
    pool = KVPool(LAYOUT, _small_policy(max_blocks=20))
    ids = pool.alloc_n(2)
    k, v = _fill(pool, ids, 3)
    addresses = [t.data_ptr() for t in pool.k + pool.v]
    pool.reserve(9)
    assert pool.num_blocks >= 9 and pool.resizes == 1
    assert [t.data_ptr() for t in pool.k + pool.v] == addresses
    k2, v2 = pool.read_blocks(ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    new = list(range(2, pool.num_blocks))
    assert all(t[new].abs().sum() == 0 for t in pool.k + pool.v)
    assert pool.nbytes == _tensor_bytes(pool) == pool.num_blocks * BPB
    pool.reserve(20)  # the cap: still in place
    assert [t.data_ptr() for t in pool.k + pool.v] == addresses and pool.num_blocks == 20


def test_a_shrunk_pool_gives_its_range_back_and_grows_in_a_new_one() -> None:
    pool = KVPool(LAYOUT, _small_policy(max_blocks=20))
    pool.reserve(12)
    old = [weakref.ref(t._base) for t in pool.k + pool.v]
    assert pool.shrink() and pool.num_blocks == 2
    assert all(ref() is None for ref in old)  # the ranges are unmapped with their last view
    ids = pool.alloc_n(5)
    k, v = _fill(pool, ids, 4)
    k2, v2 = pool.read_blocks(ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_every_layers_slabs_are_kept_until_the_slabs_move() -> None:
    """slab_lists: each layer's slabs() as two lists, the same lists while nothing moves, new ones after a
    growth that copies, none held after a shrink (its views would keep the old memory)."""
    pool = KVPool(LAYOUT, _small_policy(max_blocks=20))
    k_list, v_list = pool.slab_lists()
    for layer in range(LAYOUT.num_layers):
        k, v = pool.slabs(layer)
        assert (k_list[layer].data_ptr(), k_list[layer].shape) == (k.data_ptr(), k.shape)
        assert (v_list[layer].data_ptr(), v_list[layer].shape) == (v.data_ptr(), v.shape)
    assert pool.slab_lists()[0] is k_list
    pool.reserve(12)
    grown = pool.slab_lists()[0]
    assert grown is not k_list and grown[0].shape[0] == pool.num_blocks * LAYOUT.block_size
    old = [weakref.ref(t._base) for t in pool.k + pool.v]
    del k_list, v_list, grown, k, v  # only the pool's own lists hold the slabs now
    assert pool.shrink()
    assert all(ref() is None for ref in old)
    assert pool.slab_lists()[0][0].shape[0] == pool.num_blocks * LAYOUT.block_size


def test_where_no_range_can_be_reserved_the_pool_grows_by_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvos.memory.pool.reserve", lambda *_: None)
    pool = KVPool(LAYOUT, _small_policy())
    ids = pool.alloc_n(2)
    k, v = _fill(pool, ids, 5)
    addresses = [t.data_ptr() for t in pool.k + pool.v]
    pool.reserve(7)
    assert all(t.data_ptr() != a for t, a in zip(pool.k + pool.v, addresses, strict=True))
    k2, v2 = pool.read_blocks(ids)
    assert torch.equal(k2, k) and torch.equal(v2, v) and pool.num_blocks >= 7


def test_growth_stages_one_new_layer_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing by copying (where no range could be reserved) holds one old and one new layer at a time."""
    monkeypatch.setattr("kvos.memory.pool.reserve", lambda *_: None)
    pool = KVPool(LAYOUT, _small_policy())
    old = [weakref.ref(t) for t in pool.k + pool.v]
    alive_at_alloc: list[int] = []
    real_zeros = pool._zeros

    def counting_zeros(shape: tuple[int, ...]) -> torch.Tensor:
        alive_at_alloc.append(sum(ref() is not None for ref in old))
        return real_zeros(shape)

    monkeypatch.setattr(pool, "_zeros", counting_zeros)
    pool.reserve(3)
    # Allocating the i-th new layer tensor, exactly i old ones have been released.
    assert alive_at_alloc == [4, 3, 2, 1]
    assert all(ref() is None for ref in old)
    assert pool.num_blocks == 4  # the policy's target, no more


def test_cap_raises_with_nothing_changed() -> None:
    pool = KVPool(LAYOUT, _small_policy(max_blocks=6))
    ids = pool.alloc_n(4)
    k, v = _fill(pool, ids, 1)
    tensors = pool.k + pool.v
    before = (pool.num_blocks, pool.allocator.num_free, pool.resizes, pool.copy_seconds)
    with pytest.raises(PoolOutOfMemoryError) as info:
        pool.alloc_n(3)
    assert (info.value.needed_bytes, info.value.max_bytes, info.value.pool_bytes) == (
        7 * BPB,
        6 * BPB,
        4 * BPB,
    )
    assert (pool.num_blocks, pool.allocator.num_free, pool.resizes, pool.copy_seconds) == before
    assert all(a is b for a, b in zip(pool.k + pool.v, tensors, strict=True))
    assert not pool.can_allocate(3) and pool.can_allocate(2)
    assert pool.alloc_n(2) == [4, 5]
    assert pool.nbytes == 6 * BPB
    k2, v2 = pool.read_blocks(ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_reserve_uses_the_policy_and_cap() -> None:
    pool = KVPool(LAYOUT, _small_policy(max_blocks=10))
    pool.reserve(1)
    assert (pool.num_blocks, pool.resizes) == (2, 0)
    pool.reserve(9)
    assert (pool.num_blocks, pool.resizes) == (10, 1)  # 2 -> 4 -> 8 -> 11, clamped to 10
    with pytest.raises(PoolOutOfMemoryError):
        pool.reserve(11)
    assert pool.allocator.num_free == 10


def test_page_table_on_a_pool_is_unchanged_when_the_pool_is_full() -> None:
    pool = KVPool(LAYOUT, _small_policy(max_blocks=3))
    source: BlockSource = pool
    t = PageTable(LAYOUT.block_size, source)
    assert t.append(9) == [0, 1, 2]
    with pytest.raises(PoolOutOfMemoryError):
        t.append(4)
    assert (t.num_tokens, t.blocks, pool.live_bytes) == (9, [0, 1, 2], 3 * BPB)
    t.free_all()
    assert pool.allocator.num_free == pool.num_blocks == 3


def test_free_incref_free_n_delegate() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    a, b = pool.alloc_n(2)
    pool.incref(a)
    assert pool.free(a) is False
    pool.free_n([a, b])
    assert pool.live_bytes == 0


# ------------------------------------------------------------------ read/write


def test_read_write_blocks_round_trip() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    pool.reserve(6)
    ids = [5, 0, 3]
    k, v = _fill(pool, ids, 2)
    k2, v2 = pool.read_blocks(ids)
    assert k2.shape == (2, 3, 4, 2, 3)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert torch.equal(pool.k[1][3], k[1, 2]) and torch.equal(pool.v[0][5], v[0, 0])
    k2.zero_()  # copies: the pool is untouched
    assert torch.equal(pool.read_blocks(ids)[0], k)
    assert pool.read_blocks([])[0].shape == (2, 0, 4, 2, 3)


def test_block_access_errors() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    with pytest.raises(InvalidBlockError):
        pool.read_blocks([0, 2])
    good = torch.zeros(2, 1, 4, 2, 3)
    with pytest.raises(InvalidBlockError):
        pool.write_blocks([-1], good, good)
    with pytest.raises(ValueError, match="shape"):
        pool.write_blocks([0], torch.zeros(2, 1, 4, 3, 2), good)
    with pytest.raises(ValueError, match="shape"):
        pool.write_blocks([0, 1], good, good)


def test_gather_returns_exactly_the_written_rows_for_noncontiguous_slots() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    pool.reserve(4)
    slots = torch.tensor([13, 2, 7, 8, 0])
    k = torch.randn(5, 2, 3)
    v = torch.randn(5, 2, 3)
    pool.write(1, slots, k, v)
    gk, gv = pool.gather(1, torch.tensor([8, 13, 0]))
    assert torch.equal(gk, k[[3, 0, 4]]) and torch.equal(gv, v[[3, 0, 4]])
    assert torch.equal(pool.k[1][3, 1], k[0])  # slot 13 = block 3, offset 1
    assert torch.equal(pool.gather(0, slots)[0], torch.zeros(5, 2, 3))  # other layer untouched
    out = (torch.full((3, 2, 3), 9.0), torch.full((3, 2, 3), 9.0))
    assert pool.gather(1, torch.tensor([8, 13, 0]), out=out) is out  # written in place, same rows
    assert torch.equal(out[0], gk) and torch.equal(out[1], gv)


def test_gather_rows_reads_one_kv_head_per_row() -> None:
    """Row ``slot * num_kv_heads + head`` is that head's K/V at that slot: the values ``gather`` gives."""
    pool = KVPool(LAYOUT, _small_policy())
    pool.reserve(4)
    slots = torch.tensor([13, 2, 7])
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    pool.write(1, slots, k, v)
    rows = torch.tensor([13 * 2 + 1, 2 * 2, 7 * 2 + 1, 13 * 2])
    gk, gv = pool.gather_rows(1, rows)
    assert torch.equal(gk, torch.stack([k[0, 1], k[1, 0], k[2, 1], k[0, 0]]))
    assert torch.equal(gv, torch.stack([v[0, 1], v[1, 0], v[2, 1], v[0, 0]]))
    with pytest.raises(ValueError, match="layer"):
        pool.gather_rows(2, rows)


def test_write_and_gather_errors() -> None:
    pool = KVPool(LAYOUT, _small_policy())
    x = torch.zeros(2, 2, 3)
    with pytest.raises(ValueError, match="layer"):
        pool.write(2, torch.tensor([0, 1]), x, x)
    with pytest.raises(ValueError, match="shape"):
        pool.write(0, torch.tensor([0, 1, 2]), x, x)
    with pytest.raises(ValueError, match="1-D integer"):
        pool.gather(0, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="1-D integer"):
        pool.gather(0, torch.tensor([0.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pool_with_half_dtypes(dtype: torch.dtype) -> None:
    layout = KVLayout(2, 2, 3, block_size=4, dtype=dtype)
    pool = KVPool(layout, GrowthPolicy(initial_tokens=4))
    assert layout.bytes_per_token == 24 * dtype.itemsize
    assert pool.nbytes == _tensor_bytes(pool) == pool.num_blocks * layout.bytes_per_block
    ids = pool.alloc_n(3)  # grows 1 -> 4 blocks
    k = torch.randn(5, 2, 3, dtype=torch.float64)
    slots = torch.tensor([ids[2] * 4 + 1, ids[0] * 4, ids[1] * 4 + 3, 2, 10])
    pool.write(0, slots, k, -k)
    gk, gv = pool.gather(0, slots)
    assert gk.dtype == dtype
    assert torch.equal(gk, k.to(dtype)) and torch.equal(gv, (-k).to(dtype))
    blocks_k, blocks_v = pool.read_blocks(ids)
    pool.write_blocks(ids[::-1], blocks_k.flip(1), blocks_v.flip(1))
    assert torch.equal(pool.read_blocks(ids)[0], blocks_k)


# -------------------------------------------------- allocator + table + pool


def _token_rows(value: int, layer: int) -> torch.Tensor:
    """K row [H, D] of a token: exact small integers, distinct per token and layer."""
    base = value * 64 + layer * 8
    return torch.arange(base, base + 6, dtype=torch.float32).view(2, 3)


class PoolMachine(RuleBasedStateMachine):
    """Tables and raw blocks on one growing, capped pool, checked against a plain dict of contents."""

    tables = Bundle("tables")
    raw = Bundle("raw")

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(LAYOUT, _small_policy(max_blocks=14))
        self.tokens: dict[int, list[int]] = {}  # id(table) -> value of each token
        self.live: dict[int, PageTable] = {}
        self.raw_blocks: dict[int, torch.Tensor] = {}  # block id -> K written with write_blocks
        self.counter = 0

    @rule(target=tables)
    def new_table(self) -> PageTable:
        t = PageTable(LAYOUT.block_size, self.pool)
        self.live[id(t)] = t
        self.tokens[id(t)] = []
        return t

    @rule(t=tables, n=st.integers(0, 11))
    def append(self, t: PageTable, n: int) -> None:
        before = (t.num_tokens, t.blocks, self.pool.num_blocks, self.pool.resizes)
        if not self.pool.can_allocate(t.blocks_needed(n)):
            with pytest.raises(PoolOutOfMemoryError):
                t.append(n)
            assert (t.num_tokens, t.blocks, self.pool.num_blocks, self.pool.resizes) == before
            return
        t.append(n)
        values = list(range(self.counter, self.counter + n))
        self.counter += n
        slots = torch.tensor(t.slots(before[0], t.num_tokens), dtype=torch.long)
        for layer in range(LAYOUT.num_layers):
            k = torch.stack([_token_rows(x, layer) for x in values]) if values else torch.zeros(0, 2, 3)
            self.pool.write(layer, slots, k, -k)
        self.tokens[id(t)].extend(values)

    @rule(t=tables, data=st.data())
    def truncate(self, t: PageTable, data: st.DataObject) -> None:
        keep = data.draw(st.integers(0, t.num_tokens))
        t.truncate(keep)
        del self.tokens[id(t)][keep:]

    @rule(t=consumes(tables))
    def free_all(self, t: PageTable) -> None:
        t.free_all()
        del self.live[id(t)], self.tokens[id(t)]

    @rule(target=raw)
    def alloc_raw(self) -> int:
        if not self.pool.can_allocate(1):
            with pytest.raises(PoolOutOfMemoryError):
                self.pool.alloc()
            return -1
        block = self.pool.alloc()
        k = torch.full((2, 1, 4, 2, 3), float(1000 + block))
        self.pool.write_blocks([block], k, -k)
        self.raw_blocks[block] = k
        return block

    @rule(block=consumes(raw))
    def free_raw(self, block: int) -> None:
        if block >= 0:
            assert self.pool.free(block)
            del self.raw_blocks[block]

    @invariant()
    def contents_match_the_model(self) -> None:
        for key, t in self.live.items():
            slots = torch.tensor(t.slots(0, t.num_tokens), dtype=torch.long)
            for layer in range(LAYOUT.num_layers):
                k, v = self.pool.gather(layer, slots)
                expected = [_token_rows(x, layer) for x in self.tokens[key]]
                want = torch.stack(expected) if expected else torch.zeros(0, 2, 3)
                assert torch.equal(k, want) and torch.equal(v, -want)
        for block, k in self.raw_blocks.items():
            assert torch.equal(self.pool.read_blocks([block])[0], k)

    @invariant()
    def memory_is_accounted(self) -> None:
        pool = self.pool
        assert pool.growth.max_bytes is not None
        assert pool.nbytes == _tensor_bytes(pool) <= pool.growth.max_bytes
        held = sum(t.num_blocks for t in self.live.values()) + len(self.raw_blocks)
        assert pool.allocator.num_used == held
        assert pool.live_bytes == held * BPB

    def teardown(self) -> None:
        for t in self.live.values():
            t.free_all()
        self.pool.free_n(self.raw_blocks)
        assert self.pool.allocator.num_free == self.pool.num_blocks


PoolMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=25, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_an_empty_pool_shrinks_back_to_its_initial_size() -> None:
    """Once its last block is freed, a grown pool gives its memory back (new, initial-size tensors) and
    grows again on demand; while any block is in use, it keeps its size."""
    pool = KVPool(LAYOUT, _small_policy())
    initial = pool.num_blocks
    ids = pool.alloc_n(initial + 5)
    grown = pool.num_blocks
    assert grown > initial
    pool.free_n(ids[1:])
    assert not pool.shrink() and pool.num_blocks == grown  # one block still live
    pool.free(ids[0])
    assert pool.shrink()
    assert pool.num_blocks == initial and pool.nbytes == initial * BPB
    assert all(t.shape[0] == initial for t in pool.k + pool.v)
    assert not pool.shrink()  # already at its initial size
    again = pool.alloc_n(initial + 1)
    assert sorted(again)[:initial] == list(range(initial)) and pool.num_blocks > initial
    k, v = _fill(pool, again, 3)
    k2, v2 = pool.read_blocks(again)
    assert torch.equal(k2, k) and torch.equal(v2, v)
