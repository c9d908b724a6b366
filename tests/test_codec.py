"""The chunk store's sparse codec: exact round trips, the smaller form chosen, exact byte counts, and its use
by ChunkStore in RAM and on disk (checksummed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvos.errors import CorruptChunkError
from kvos.memory.codec import encode, from_payload, sparse_nbytes
from kvos.memory.store import FILE_SUFFIX, ChunkStore

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPE = (2, 16, 2, 8)  # [num_layers, n, num_kv_heads, head_dim]: 512 elements


def with_zeros(
    fraction: float, dtype: torch.dtype, seed: int = 0, shape: tuple[int, ...] = SHAPE
) -> torch.Tensor:
    """Random nonzero values with exactly ``round(fraction * numel)`` elements set to +0.0."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape, generator=g) + 0.5) * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = x.to(dtype)
    numel = x.numel()
    zero = torch.randperm(numel, generator=g)[: round(fraction * numel)]
    x.view(-1)[zero] = 0.0
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


def through_payload(x: torch.Tensor) -> torch.Tensor:
    enc = encode(x)
    payload = memoryview(b"".join(bytes(c) for c in enc.buffers()))
    back, end = from_payload(enc.spec(), payload, 0)
    assert end == len(payload) == enc.nbytes
    return back.decode()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.9])
def test_round_trips_are_bit_exact(dtype: torch.dtype, fraction: float) -> None:
    x = with_zeros(fraction, dtype)
    flat = x.view(-1)
    flat[1], flat[2], flat[3] = float("nan"), float("-inf"), -0.0  # -0.0 is not "zero": its bits are kept
    enc = encode(x)
    n, itemsize = x.numel(), dtype.itemsize
    nnz = int((x.view({4: torch.int32, 2: torch.int16}[itemsize]) != 0).sum())
    assert enc.sparse == (sparse_nbytes(n, nnz, itemsize) < n * itemsize)
    assert enc.nbytes == min(n * itemsize, (n + 7) // 8 + nnz * itemsize)
    assert same_bits(enc.decode(), x)
    assert same_bits(through_payload(x), x)
    assert torch.signbit(enc.decode().view(-1)[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_is_kept_unless_sparse_is_strictly_smaller(dtype: torch.dtype) -> None:
    # 512 elements: the mask costs 64 bytes, so sparse wins once the zeros save more than 64 value bytes
    break_even = 64 // dtype.itemsize  # 16 zeros for float32, 32 for 16-bit dtypes: a tie, kept dense
    for zeros in (0, break_even):
        x = with_zeros(zeros / 512, dtype)
        enc = encode(x)
        assert not enc.sparse and enc.nbytes == x.nbytes == 512 * dtype.itemsize and enc.values is x
    enc = encode(with_zeros((break_even + 1) / 512, dtype))
    assert enc.sparse and enc.nbytes == 512 * dtype.itemsize - dtype.itemsize
    assert encode(torch.zeros(0, 3, dtype=dtype)).nbytes == 0


def test_half_zero_float32_tensor_is_one_32nd_plus_one_half_of_dense() -> None:
    x = with_zeros(0.5, torch.float32)  # 512 elements, 256 zeros
    enc = encode(x)
    assert enc.sparse and enc.raw_bytes == 2048
    assert enc.nbytes == 512 // 8 + 256 * 4 == 1088 == 2048 * (1 / 32 + 1 / 2)


def test_store_counts_encoded_bytes_in_ram_and_reports_raw_and_stored(tmp_path: Path) -> None:
    k, v = with_zeros(0.5, torch.float32, 1), with_zeros(0.5, torch.float32, 2)
    dense_k, dense_v = with_zeros(0.0, torch.float32, 3), with_zeros(0.0, torch.float32, 4)
    store = ChunkStore(disk_dir=tmp_path)
    store.put("sparse", k, v)
    assert store.ram_bytes_used == 2 * 1088
    store.put("dense", dense_k, dense_v)
    assert store.ram_bytes_used == 2 * 1088 + 2 * 2048
    stats = store.stats()
    assert stats["raw_bytes"] == 4 * 2048 and stats["stored_bytes"] == 2 * 1088 + 2 * 2048
    got = store.get("sparse")
    assert same_bits(got.k, k) and same_bits(got.v, v)


def test_sparse_entry_spilled_to_disk_loads_back_exact_and_is_checksummed(tmp_path: Path) -> None:
    k, v = with_zeros(0.9, torch.bfloat16, 5), with_zeros(0.3, torch.bfloat16, 6)
    k.view(-1)[7] = -0.0
    store = ChunkStore(ram_bytes=0, disk_dir=tmp_path)
    store.put("b", k, v, {"start": 3})
    (name,) = [p for p in tmp_path.iterdir() if p.name.endswith(FILE_SUFFIX)]
    stored = encode(k).nbytes + encode(v).nbytes
    assert store.where("b") == "disk" and store.stats()["stored_bytes"] == stored
    assert stored < k.nbytes + v.nbytes and name.stat().st_size < k.nbytes + v.nbytes
    got = store.get("b")  # still too big for RAM: read from the file
    assert same_bits(got.k, k) and same_bits(got.v, v) and got.meta == {"start": 3}

    data = bytearray(name.read_bytes())
    data[-3] ^= 0x01  # one bit of V's values
    name.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError):
        store.get("b")
    assert store.take_dropped() == ["b"] and "b" not in store and not name.exists()


def test_disk_entry_loaded_into_ram_keeps_its_encoded_size(tmp_path: Path) -> None:
    k, v = with_zeros(0.9, torch.float16, 7), with_zeros(0.9, torch.float16, 8)
    size = encode(k).nbytes + encode(v).nbytes
    store = ChunkStore(ram_bytes=size, disk_dir=tmp_path)
    store.put("a", k, v)
    store.put("b", k.clone(), v.clone())  # spills a
    assert store.where("a") == "disk" and store.ram_bytes_used == size
    got = store.get("a")  # a comes back to RAM, b spills
    assert store.where("a") == "ram" and store.ram_bytes_used == size
    assert same_bits(got.k, k) and same_bits(got.v, v)


def test_mask_is_numpy_packbits_of_the_nonzero_pattern() -> None:
    x = with_zeros(0.7, torch.float32, 9)
    enc = encode(x)
    assert enc.mask is not None
    assert np.array_equal(enc.mask, np.packbits((x != 0).reshape(-1).numpy()))
    assert torch.equal(enc.values, x[x != 0])
