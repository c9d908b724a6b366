"""ChunkStore: bit-exact round trips, LRU tiers under caps, spill files, drops, corruption, stateful model."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvos.errors import ChunkDataError, ChunkNotFoundError, ConfigError, CorruptChunkError, KvosError
from kvos.memory.store import FILE_SUFFIX, ChunkStore

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CHUNK = 64  # payload bytes of chunk(): k and v each [1, 2, 2, 2] float32 = 32 bytes


def chunk(
    seed: int, shape: tuple[int, ...] = (1, 2, 2, 2), dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of ``shape`` ``[num_layers, num_tokens, num_kv_heads, head_dim]``, distinct per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.device.type == "cpu"
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def tiers(store: ChunkStore, keys: Sequence[Hashable]) -> str:
    """One letter per key: r(am), d(isk) or -(absent)."""
    return "".join({"ram": "r", "disk": "d", None: "-"}[store.where(key)] for key in keys)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ram_bytes", [None, 0])
def test_round_trip_is_bit_exact_in_ram_and_on_disk(
    tmp_path: Path, dtype: torch.dtype, ram_bytes: int | None
) -> None:
    k, v = chunk(1, (2, 5, 3, 4), dtype)
    k[0, 0, 0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0])
    store = ChunkStore(ram_bytes=ram_bytes, disk_dir=tmp_path)
    store.put("b", k, v, {"tokens": [1, 2, 3], "start": 7})
    assert store.where("b") == ("disk" if ram_bytes == 0 else "ram")
    got = store.get("b")
    assert same_bits(got.k, k) and same_bits(got.v, v)
    assert got.meta == {"tokens": [1, 2, 3], "start": 7}


def test_put_copies_so_the_caller_may_reuse_its_tensors(tmp_path: Path) -> None:
    k, v = chunk(2, (2, 4, 2, 3))
    k_t = k.transpose(1, 2)  # non-contiguous input
    store = ChunkStore()
    store.put(0, k_t, v)
    expected = k_t.clone()
    k.zero_()
    assert same_bits(store.get(0).k, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_put_from_an_accelerator_returns_cpu_tensors(tmp_path: Path) -> None:
    k, v = chunk(3, (2, 4, 2, 8), torch.bfloat16)
    store = ChunkStore(ram_bytes=0, disk_dir=tmp_path)
    store.put("g", k.to("cuda"), v.to("cuda"))
    got = store.get("g")
    assert same_bits(got.k, k) and same_bits(got.v, v)


def test_put_without_copy_keeps_contiguous_cpu_tensors_and_copies_the_rest() -> None:
    store = ChunkStore()
    k, v = chunk(5)
    store.put("own", k, v, copy=False)
    got = store.get("own")
    assert got.k.data_ptr() == k.data_ptr() and got.v.data_ptr() == v.data_ptr()
    strided = k.transpose(1, 2)  # not contiguous: copied into the store's own tensor
    store.put("strided", strided, strided, copy=False)
    got = store.get("strided")
    assert got.k.is_contiguous() and torch.equal(got.k, strided) and got.k.data_ptr() != k.data_ptr()


def test_tensors_that_require_grad_are_stored_detached() -> None:
    k, v = chunk(4)
    store = ChunkStore()
    store.put(0, k.requires_grad_(), v)
    got = store.get(0)
    assert not got.k.requires_grad and same_bits(got.k, k.detach())


def test_meta_round_trips_through_json_alike_in_both_tiers(tmp_path: Path) -> None:
    meta = {"ids": (1, 2), "pos": [3, 4], "text": "héllo", "nested": {"a": None, "b": 1.5}}
    expected = {"ids": [1, 2], "pos": [3, 4], "text": "héllo", "nested": {"a": None, "b": 1.5}}
    store = ChunkStore(ram_bytes=CHUNK, disk_dir=tmp_path)
    store.put("x", *chunk(1), meta)
    assert store.get("x").meta == expected
    store.put("y", *chunk(2))  # spills x
    assert store.where("x") == "disk"
    assert store.get("x").meta == expected
    assert store.get("y").meta == {}
    with pytest.raises(ChunkDataError, match="JSON"):
        store.put("z", *chunk(3), {"bad": object()})
    assert "z" not in store
    positions = store.get("x").meta_int64("pos")
    assert positions.dtype == torch.int64 and positions.tolist() == [3, 4]
    store.put("w", *chunk(4), {"pos": []})
    assert store.get("w").meta_int64("pos").shape == (0,)


def test_lru_order_under_a_ram_cap_and_disk_loads_come_back_to_ram(tmp_path: Path) -> None:
    store = ChunkStore(ram_bytes=3 * CHUNK, disk_dir=tmp_path)
    for i, key in enumerate("abc"):
        store.put(key, *chunk(i))
    assert tiers(store, "abc") == "rrr"
    store.get("a")  # recency now b, c, a
    store.put("d", *chunk(3))
    assert tiers(store, "abcd") == "rdrr"
    store.put("e", *chunk(4))
    assert tiers(store, "abcde") == "rddrr"
    assert store.keys() == ["b", "c", "a", "d", "e"]
    got = store.get("b")  # back into RAM as most recent; a (least recent in RAM) spills
    assert same_bits(got.k, chunk(1)[0]) and same_bits(got.v, chunk(1)[1])
    assert tiers(store, "abcde") == "drdrr"
    assert store.keys() == ["c", "a", "d", "e", "b"]
    assert store.ram_bytes_used == 3 * CHUNK
    s = store.stats()
    assert (s["entries_ram"], s["entries_disk"], s["spills"], s["disk_loads"], s["drops"]) == (3, 2, 3, 1, 0)
    assert (s["puts"], s["gets"]) == (5, 2)


def test_spill_writes_one_file_per_chunk_and_counters_equal_the_sums(tmp_path: Path) -> None:
    store = ChunkStore(ram_bytes=2 * CHUNK, disk_dir=tmp_path)
    for i in range(5):
        store.put(("s", i), *chunk(i))
    names = files(tmp_path)
    assert len(names) == 3 and all(n.endswith(FILE_SUFFIX) for n in names)
    assert [store.where(("s", i)) for i in range(5)] == ["disk"] * 3 + ["ram"] * 2
    assert store.ram_bytes_used == 2 * CHUNK
    assert store.disk_bytes_used == sum((tmp_path / n).stat().st_size for n in names)
    s = store.stats()
    assert (s["ram_bytes"], s["disk_bytes"]) == (store.ram_bytes_used, store.disk_bytes_used)
    for i in range(5):
        assert same_bits(store.get(("s", i)).v, chunk(i)[1])


def test_without_disk_the_lru_entry_is_dropped_and_reported(tmp_path: Path) -> None:
    store = ChunkStore(ram_bytes=2 * CHUNK)
    for i in range(3):
        store.put(i, *chunk(i))
    assert store.take_dropped() == [0] and store.keys() == [1, 2] and store.stats()["drops"] == 1
    assert store.take_dropped() == []  # each drop is reported once
    with pytest.raises(ChunkNotFoundError, match=r"no chunk 0 .*dropped") as info:
        store.get(0)
    assert isinstance(info.value, KeyError) and isinstance(info.value, KvosError)
    with pytest.raises(ChunkNotFoundError, match="never put"):
        store.get(99)
    store.put(0, *chunk(0))  # a dropped key can be put again
    assert store.take_dropped() == [1]


def test_a_key_put_again_before_its_drop_is_taken_is_not_reported(tmp_path: Path) -> None:
    store = ChunkStore(ram_bytes=2 * CHUNK)
    for i in range(3):
        store.put(i, *chunk(i))  # 0 is dropped
    store.delete(1)
    store.put(0, *chunk(5))  # held again: its owner must not take the new entry for lost
    assert store.take_dropped() == [] and same_bits(store.get(0).k, chunk(5)[0])


def test_an_entry_larger_than_ram_goes_straight_to_disk_or_is_dropped(tmp_path: Path) -> None:
    big = chunk(7, (2, 4, 2, 2))  # 128 bytes
    store = ChunkStore(ram_bytes=CHUNK, disk_dir=tmp_path)
    store.put("small", *chunk(1))
    store.put("big", *big)
    assert tiers(store, ["small", "big"]) == "rd"  # the small one was not spilled for it
    assert same_bits(store.get("big").k, big[0])
    assert store.where("big") == "disk"  # too large for RAM, so it stays on disk
    no_disk = ChunkStore(ram_bytes=CHUNK)
    no_disk.put("big", *big)
    assert no_disk.take_dropped() == ["big"] and len(no_disk) == 0


def test_disk_cap_drops_the_lru_disk_entry_and_deletes_its_file(tmp_path: Path) -> None:
    probe = ChunkStore(ram_bytes=0, disk_dir=tmp_path / "probe")
    probe.put("a", *chunk(0), {"n": 0})
    file_size = probe.disk_bytes_used
    store = ChunkStore(ram_bytes=0, disk_dir=tmp_path / "d", disk_bytes=2 * file_size)
    store.put("a", *chunk(0), {"n": 0})
    store.put("b", *chunk(1), {"n": 1})
    store.get("a")  # a stays on disk (ram_bytes=0) but is now more recent than b
    before = set(files(tmp_path / "d"))
    store.put("c", *chunk(2), {"n": 2})
    assert store.take_dropped() == ["b"] and store.keys() == ["a", "c"]
    assert len(files(tmp_path / "d")) == 2 and len(before - set(files(tmp_path / "d"))) == 1
    assert store.disk_bytes_used == 2 * file_size
    tiny = ChunkStore(ram_bytes=0, disk_dir=tmp_path / "t", disk_bytes=10)
    tiny.put("x", *chunk(3))
    assert tiny.take_dropped() == ["x"] and files(tmp_path / "t") == []


def put_on_disk(store: ChunkStore, d: Path, key: str, seed: int) -> Path:
    before = set(files(d))
    store.put(key, *chunk(seed))
    (new,) = set(files(d)) - before
    return d / new


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "flip_magic", "delete"])
def test_a_damaged_file_raises_corrupt_chunk_error_and_the_entry_is_removed(
    tmp_path: Path, damage: str
) -> None:
    store = ChunkStore(ram_bytes=0, disk_dir=tmp_path)
    path = put_on_disk(store, tmp_path, "bad", 1)
    put_on_disk(store, tmp_path, "good", 2)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        data[-1] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_magic":
        data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    if damage == "delete":
        path.unlink()
    with pytest.raises(CorruptChunkError, match=path.name) as info:
        store.get("bad")
    assert info.value.key == "bad" and info.value.path == path
    assert "bad" not in store and not path.exists() and store.take_dropped() == ["bad"]
    assert store.stats()["corrupt"] == 1 and store.stats()["drops"] == 0
    with pytest.raises(ChunkNotFoundError, match="corrupt"):
        store.get("bad")
    assert same_bits(store.get("good").k, chunk(2)[0])
    assert store.disk_bytes_used == sum((tmp_path / n).stat().st_size for n in files(tmp_path))


def test_writes_leave_no_temporary_files_even_when_a_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ChunkStore(ram_bytes=CHUNK, disk_dir=tmp_path)
    for i in range(6):
        store.put(i, *chunk(i))
    assert len(files(tmp_path)) == 5 and all(n.endswith(FILE_SUFFIX) for n in files(tmp_path))

    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    store.put(6, *chunk(6))  # spilling 5 fails: it is dropped, the put itself succeeds
    assert store.take_dropped() == [5] and len(files(tmp_path)) == 5 and store.where(6) == "ram"


def test_delete_pop_replace_and_close_remove_files(tmp_path: Path) -> None:
    store = ChunkStore(ram_bytes=0, disk_dir=tmp_path)
    for i in range(4):
        store.put(i, *chunk(i))
    store.delete(0)
    assert len(files(tmp_path)) == 3 and 0 not in store
    popped = store.pop(1)
    assert same_bits(popped.k, chunk(1)[0]) and 1 not in store and len(files(tmp_path)) == 2
    store.put(2, *chunk(9))  # replace: the old file goes, and it is no drop
    assert len(files(tmp_path)) == 2 and same_bits(store.get(2).k, chunk(9)[0])
    with pytest.raises(ChunkNotFoundError):
        store.delete(0)
    with pytest.raises(ChunkNotFoundError):
        store.pop(0)
    store.close()
    assert files(tmp_path) == [] and len(store) == 0 and store.disk_bytes_used == 0
    assert store.take_dropped() == []
    store.close()


def test_two_stores_can_share_a_directory(tmp_path: Path) -> None:
    a, b = ChunkStore(ram_bytes=0, disk_dir=tmp_path), ChunkStore(ram_bytes=0, disk_dir=tmp_path)
    a.put(0, *chunk(1))
    b.put(0, *chunk(2))
    assert len(files(tmp_path)) == 2
    a.close()
    assert len(files(tmp_path)) == 1 and same_bits(b.get(0).k, chunk(2)[0])


def test_bad_configuration_and_inputs_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ram_bytes"):
        ChunkStore(ram_bytes=-1)
    with pytest.raises(ConfigError, match="disk_dir"):
        ChunkStore(disk_bytes=100)
    with pytest.raises(ChunkDataError, match=r"torch\.Tensor"):
        ChunkStore().put(0, [1.0], torch.zeros(1))  # type: ignore[arg-type]


KEYS = st.sampled_from([0, 1, 2, "a", ("s", 3)])


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/pop/delete under random caps against a dict model with an exact recency order."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvos-store-"))
        self.model: dict[Hashable, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = {}
        self.order: list[Hashable] = []  # least recently used first
        self.puts = 0
        self.ram_cap: int | None = None
        self.store = ChunkStore()

    @initialize(
        ram=st.one_of(st.none(), st.integers(0, 200)),
        use_disk=st.booleans(),
        disk=st.one_of(st.none(), st.integers(0, 1500)),
    )
    def setup(self, ram: int | None, use_disk: bool, disk: int | None) -> None:
        self.ram_cap = ram
        self.store = ChunkStore(
            ram_bytes=ram,
            disk_dir=self.dir if use_disk else None,
            disk_bytes=disk if use_disk else None,
        )

    def touch(self, key: Hashable) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    def forget(self, key: Hashable) -> None:
        del self.model[key]
        self.order.remove(key)

    def sync_drops(self) -> None:
        new = self.store.take_dropped()
        assert len(set(new)) == len(new)
        assert set(new) == set(self.model) - set(self.store.keys())
        for key in new:
            self.forget(key)

    @rule(key=KEYS, tokens=st.integers(0, 3), layers=st.integers(1, 2), dtype=st.sampled_from(DTYPES))
    def put(self, key: Hashable, tokens: int, layers: int, dtype: torch.dtype) -> None:
        self.puts += 1
        seed = self.puts
        k, v = chunk(seed, (layers, tokens, 1, 2), dtype)
        meta = {"seed": seed, "key": repr(key)}
        self.store.put(key, k, v, meta)
        self.model[key] = (k, v, meta)
        self.touch(key)
        self.sync_drops()

    @rule(key=KEYS)
    def get(self, key: Hashable) -> None:
        if key not in self.model:
            with pytest.raises(ChunkNotFoundError):
                self.store.get(key)
            return
        got = self.store.get(key)
        k, v, meta = self.model[key]
        assert same_bits(got.k, k) and same_bits(got.v, v) and got.meta == meta
        self.touch(key)
        self.sync_drops()

    @rule(key=KEYS, pop=st.booleans())
    def remove(self, key: Hashable, pop: bool) -> None:
        if key not in self.model:
            with pytest.raises(ChunkNotFoundError):
                self.store.pop(key) if pop else self.store.delete(key)
            return
        if pop:
            assert same_bits(self.store.pop(key).v, self.model[key][1])
        else:
            self.store.delete(key)
        self.forget(key)
        self.sync_drops()

    @invariant()
    def matches_the_model(self) -> None:
        store = self.store
        assert store.keys() == self.order and len(store) == len(self.model)
        assert self.ram_cap is None or store.ram_bytes_used <= self.ram_cap
        ram = [key for key in self.order if store.where(key) == "ram"]
        assert store.ram_bytes_used == sum(self.model[key][0].nbytes * 2 for key in ram)
        names = files(self.dir)
        assert all(n.endswith(FILE_SUFFIX) for n in names) and len(names) == len(self.order) - len(ram)
        assert store.disk_bytes_used == sum((self.dir / n).stat().st_size for n in names)

    @invariant()
    def ram_holds_the_most_recent(self) -> None:
        """Every RAM entry is more recent than every disk entry that would fit in RAM."""
        where = [self.store.where(key) for key in self.order]
        fits = [self.ram_cap is None or self.model[key][0].nbytes * 2 <= self.ram_cap for key in self.order]
        last_disk = max(
            (i for i, (w, f) in enumerate(zip(where, fits, strict=True)) if w == "disk" and f), default=-1
        )
        assert "ram" not in where[: last_disk + 1]

    def teardown(self) -> None:
        self.store.close()
        assert files(self.dir) == []
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_store_matches_a_dict_model = StoreMachine.TestCase
