"""Saved K/V in mappings of their own: a large host tensor's pages go back to the system when it is freed,
whatever else the C heap holds (kvos.memory.mapped), and the store and the engine's read-out use them."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from kvos.engine.engine import Engine
from kvos.memory.mapped import MAPPED_MIN_BYTES, mapped_copy, mapped_empty
from kvos.memory.store import ChunkStore
from kvos.model.loader import load_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def mapped_ranges() -> list[tuple[int, int]]:
    """The address ranges this process has mapped now (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def is_mapped(address: int) -> bool:
    return any(lo <= address < hi for lo, hi in mapped_ranges())


def test_a_large_tensor_is_unmapped_when_its_last_view_goes() -> None:
    shape = (4, 48, 2, 64)  # 96 KiB: under glibc's own mapping threshold (128 KiB), so from its heap
    t = mapped_empty(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(1.5)
    address, view = t.data_ptr(), t[2]
    assert address % mmap.PAGESIZE == 0 and is_mapped(address)
    del t
    gc.collect()
    assert is_mapped(address)  # a view still holds it
    assert float(view.sum()) == 1.5 * 48 * 2 * 64
    del view
    gc.collect()
    assert not is_mapped(address)


def test_small_tensors_come_from_the_heap() -> None:
    heap = mapped_empty((MAPPED_MIN_BYTES // 4 - 1,), torch.float32)
    address = heap.data_ptr()
    del heap
    gc.collect()
    assert is_mapped(address)  # freed into the heap, which stays mapped
    assert mapped_empty((0, 3), torch.bfloat16).shape == (0, 3)


def test_out_of_mappings_falls_back_to_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    t = mapped_empty((1 << 20,), torch.float16)
    assert t.shape == (1 << 20,) and t.dtype == torch.float16
    t.fill_(2.0)
    assert float(t[-1]) == 2.0


def test_mapped_copy_is_bit_exact() -> None:
    x = torch.randn(3, 2, 100, 64).to(torch.bfloat16)
    x[0, 0, 0, 0] = -0.0
    strided = x.transpose(1, 2)  # [3, 100, 2, 64], not contiguous
    y = mapped_copy(strided)
    assert y.is_contiguous() and y.shape == strided.shape and y.nbytes >= MAPPED_MIN_BYTES
    assert torch.equal(y.view(torch.int16), strided.contiguous().view(torch.int16))


def test_what_the_store_keeps_goes_back_to_the_system_when_deleted(tmp_path: Path) -> None:
    """A chunk put with a copy, and one read back from disk into RAM: both held in mappings that are gone
    once the store lets go of them."""
    store = ChunkStore(ram_bytes=300_000, disk_dir=str(tmp_path))
    k, v = torch.randn(4, 48, 2, 64), torch.randn(4, 48, 2, 64)  # 96 KiB each
    store.put("a", k, v, {"positions": list(range(64))})
    kept = store.get("a").k.data_ptr()
    assert kept != k.data_ptr() and is_mapped(kept)
    store.put("b", k * 2, v * 2)  # over the RAM cap: "a" spills to disk
    assert store.where("a") == "disk"
    gc.collect()
    assert not is_mapped(kept)
    back = store.get("a")  # read back into RAM
    assert torch.equal(back.k, k) and torch.equal(back.v, v)
    loaded = back.k.data_ptr()
    del back
    store.delete("a")
    store.delete("b")
    gc.collect()
    assert not is_mapped(loaded)


def test_a_segments_read_out_has_mappings_of_its_own(model_dir: Path) -> None:
    """What page-out hands the store (``Engine.read_kv``): on the CPU, K and V each in a mapping of their
    own, gone when they are."""
    engine = Engine(load_model(model_dir), block_size=4)
    seq = engine.new_sequence()
    engine.extend(seq, list(range(3, 293)))
    k, v = engine.read_kv(seq.segments[0])
    assert k.shape[1] == 290 and k.nbytes >= MAPPED_MIN_BYTES
    addresses = k.data_ptr(), v.data_ptr()
    assert all(a % mmap.PAGESIZE == 0 and is_mapped(a) for a in addresses)
    del k, v
    gc.collect()
    assert not any(is_mapped(a) for a in addresses)
    engine.release(seq)
