"""Session snapshots: a session saved to disk and restored elsewhere is the same session, bit for bit, and
keeps decoding identically; corrupt, truncated or other-version files are detected and never served."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvos.engine.engine import Engine
from kvos.engine.sampling import SamplingParams
from kvos.errors import SnapshotError
from kvos.memory import container
from kvos.memory.store import FILE_SUFFIX, ChunkStore
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkState
from kvos.policy.compression import parse_compression
from kvos.session import fields, snapshot
from kvos.session.config import SessionConfig
from kvos.session.embedder import DEFAULT_EMBEDDER, EmbedderName
from kvos.session.manager import MemoryManager
from kvos.session.session import Session

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
FILLER = "the quick brown fox jumps over the lazy dog while it rains "


def durable(directory: Path) -> Callable[[str], ChunkStore]:
    """A store factory: every session's saved chunks written through to ``directory``."""
    return lambda _: ChunkStore(disk_dir=directory, write_through=True)


def manager(
    model_dir: Path,
    directory: Path,
    mode: str = "compact",
    signal: str = "lexical",
    embedder: EmbedderName = DEFAULT_EMBEDDER,
    compression: str = "none",
) -> MemoryManager:
    config = SessionConfig(
        budget=Budget(max_active_tokens=160, policy="watermark"),
        chunk_tokens=24,
        position_mode=mode,  # type: ignore[arg-type]
        recovery_signal=signal,  # type: ignore[arg-type]
        embedder=embedder,
        kv_compression=parse_compression(compression),
    )
    engine = Engine(load_model(model_dir), block_size=8)
    return MemoryManager(engine, load_tokenizer(model_dir), config, store_factory=durable(directory))


def conversation(s: Session, turns: int) -> None:
    s.add_message("system", "You keep notes.")
    for i in range(turns):
        s.add_message("user", f"note {i}: crate {i * 37 % 101} holds {i % 9} lanterns; " + FILLER)
        s.generate(GREEDY)


def resident_kv(s: Session) -> list[tuple[int, list[int], torch.Tensor, torch.Tensor]]:
    out = []
    for cid in s.pager.order():
        seg = s.pager.segments[cid]
        out.append((cid, seg.positions.tolist(), *s.engine.read_kv(seg)))
    return out


def restored(
    model_dir: Path,
    source: Path,
    target: Path,
    mode: str = "compact",
    signal: str = "lexical",
    compression: str = "none",
) -> Session:
    """The session saved in ``source``, restored from a copy of it (a restart reads what is on disk)."""
    shutil.copytree(source, target)
    (path,) = target.glob(f"*{snapshot.SUFFIX}")
    s = manager(model_dir, target, mode, signal, compression=compression).session("s")
    snapshot.restore(snapshot.load(path), s, target)
    return s


@pytest.mark.parametrize(
    ("mode", "signal", "compression"),
    [
        ("compact", "lexical", "none"),
        ("sparse", "lexical", "none"),
        ("compact", "attention", "none"),
        ("compact", "lexical", "sparse:sweet"),
    ],
)
def test_round_trip_is_bit_exact_and_keeps_decoding_identically(
    model_dir: Path, tmp_path: Path, mode: str, signal: str, compression: str
) -> None:
    original = manager(model_dir, tmp_path / "a", mode, signal, compression=compression).session("s")
    conversation(original, 5)
    assert original.stats()["chunks"]["saved"] > 0  # evicted chunks are in the store, on disk already
    snapshot.save(original, tmp_path / "a", "s-1.snap")
    copy = restored(model_dir, tmp_path / "a", tmp_path / "b", mode, signal, compression)
    if compression != "none":  # compressed chunks keep their count, so none is sparsified twice
        assert any(c.compressed_tokens for c in copy.chunks.values())

    assert copy.history.token_ids() == original.history.token_ids() and copy.swapped
    copy.swap_in()
    ta, tb = fields.TensorTable(), fields.TensorTable()  # every chunk field, tensors included
    assert [fields.encode_chunk(c, ta) for c in original.chunks.values()] == [
        fields.encode_chunk(c, tb) for c in copy.chunks.values()
    ]
    assert ta.tensors.keys() == tb.tensors.keys()
    assert all(torch.equal(ta.tensors[name], tb.tensors[name]) for name in ta.tensors)
    if signal == "attention":  # saved chunks keep their key digests across the restart
        assert any(name.endswith(".digest.lo") for name in ta.tensors)
    assert [(cid, pos) for cid, pos, *_ in resident_kv(copy)] == [
        (cid, pos) for cid, pos, *_ in resident_kv(original)
    ]
    for (_, _, k1, v1), (_, _, k2, v2) in zip(resident_kv(original), resident_kv(copy), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for cid, chunk in original.chunks.items():
        if chunk.state is ChunkState.SAVED:
            a, b = original.pager.store.get(cid), copy.pager.store.get(cid)  # type: ignore[union-attr]
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.meta == b.meta
    assert copy.history.turn == original.history.turn and copy.history.protected == original.history.protected
    assert copy.memory.focus.vector is not None and original.memory.focus.vector is not None
    assert torch.equal(copy.memory.focus.vector, original.memory.focus.vector)
    for s in (original, copy):
        s.add_message("user", "which crate holds the lanterns? " + FILLER)
    assert copy.generate(GREEDY) == original.generate(GREEDY)


@pytest.mark.parametrize("written", ["hidden", None])  # None: a snapshot from before the key, by kvos serve
def test_embeddings_of_another_embedder_are_made_again_not_compared(
    model_dir: Path, tmp_path: Path, written: str | None
) -> None:
    original = manager(model_dir, tmp_path / "a", embedder="hidden").session("s")
    conversation(original, 5)
    assert original.memory.focus.vector is not None
    assert any(c.embedding is not None for c in original.chunks.values())
    snap = snapshot.save(original, tmp_path / "a", "s-1.snap")
    if written is None:
        del snap.header["memory"]["embedder"]
        container.write_atomic(tmp_path / "a" / "s-1.snap", container.pack(snapshot.MAGIC, snapshot.VERSION,
                               snap.header, snap.table.specs_and_buffers()[1]))  # fmt: skip

    copy = restored(model_dir, tmp_path / "a", tmp_path / "b")  # the default embedder: tokens
    assert copy.config.embedder == "tokens" != original.config.embedder
    assert copy.memory.focus.vector is None
    assert all(c.embedding is None for c in copy.chunks.values())
    assert copy.history.token_ids() == original.history.token_ids()
    copy.swap_in()
    copy.add_message("user", "which crate holds the lanterns? " + FILLER)
    copy.generate(GREEDY)  # evicts again, scoring chunks embedded by its own embedder
    embedded = [c.embedding for c in copy.chunks.values() if c.embedding is not None]
    assert embedded and copy.memory.focus.vector is not None
    for chunk in copy.chunks.values():
        if chunk.embedding is not None:
            assert torch.equal(chunk.embedding, copy.embed(chunk.token_ids))


@pytest.fixture(scope="module")
def saved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, snapshot.SessionSnapshot]:
    """One conversation with resident and saved chunks, snapshotted: (its directory, the snapshot). Tests
    damage copies of it."""
    directory = tmp_path_factory.mktemp("saved")
    s = manager(model_dir, directory).session("s")
    conversation(s, 5)
    snap = snapshot.save(s, directory, "s-1.snap")
    assert s.stats()["chunks"]["saved"] > 0 and snap.header["cache"]
    return directory, snap


def test_a_resident_chunk_with_a_bad_file_is_recomputed_not_served(
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    saved: tuple[Path, snapshot.SessionSnapshot],
) -> None:
    source, snap = saved
    shutil.copytree(source, tmp_path / "a")
    cache = snap.header["cache"]
    flipped, truncated = (snap.files[cid] for cid, _ in cache[-2:])
    path = tmp_path / "a" / flipped
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # one bit of the payload: only the digest sees it
    path.write_bytes(bytes(data))
    cut = tmp_path / "a" / truncated
    cut.write_bytes(cut.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING):
        copy = restored(model_dir, tmp_path / "a", tmp_path / "b")
        copy.swap_in()
    assert copy.stats()["recoveries_recompute"] == 2  # both recomputed from their tokens at swap-in
    assert "checksum mismatch" in caplog.text and "cannot be restored" in caplog.text
    assert copy.history.token_ids() == snap.token_ids()
    assert [cid for cid, *_ in resident_kv(copy)] == [cid for cid, _ in cache]
    assert copy.pager.store.stats()["corrupt"] == 1  # type: ignore[union-attr]


def test_a_saved_chunk_with_a_bad_file_becomes_a_breadcrumb(
    model_dir: Path, tmp_path: Path, saved: tuple[Path, snapshot.SessionSnapshot]
) -> None:
    source, snap = saved
    shutil.copytree(source, tmp_path / "a")
    resident = {cid for cid, _ in snap.header["cache"]}
    kept = sorted(cid for cid in snap.files if cid not in resident)
    (tmp_path / "a" / snap.files[kept[0]]).write_bytes(b"KVOSBLK")  # truncated inside its prefix
    copy = restored(model_dir, tmp_path / "a", tmp_path / "b")
    assert copy.chunks[kept[0]].state is ChunkState.DISCARDED
    assert all(copy.chunks[cid].state is ChunkState.SAVED for cid in kept[1:])


def test_a_saved_chunk_whose_file_fails_its_digest_is_recomputed_when_recovered(
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    saved: tuple[Path, snapshot.SessionSnapshot],
) -> None:
    source, snap = saved
    shutil.copytree(source, tmp_path / "a")
    resident = {cid for cid, _ in snap.header["cache"]}
    cid = min(c for c in snap.files if c not in resident)
    path = tmp_path / "a" / snap.files[cid]
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x08  # the file's size and prefix are right: only reading it finds out
    path.write_bytes(bytes(data))
    copy = restored(model_dir, tmp_path / "a", tmp_path / "b")
    copy.swap_in()
    chunk = copy.chunks[cid]
    assert chunk.state is ChunkState.SAVED
    with caplog.at_level(logging.WARNING):
        assert copy.memory.recover(chunk)
    assert chunk.resident and "checksum mismatch" in caplog.text and "recomputing" in caplog.text
    assert copy.pager.store.stats()["corrupt"] == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("damage", ["flip", "truncate", "version", "older"])
def test_a_damaged_snapshot_is_refused(
    tmp_path: Path, damage: str, saved: tuple[Path, snapshot.SessionSnapshot]
) -> None:
    path = tmp_path / "s-1.snap"
    data = bytearray((saved[0] / "s-1.snap").read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 7]
    else:  # a later version, or version 1, written before chunks were named so (its header has "blocks")
        data[8:10] = (snapshot.VERSION + 1 if damage == "version" else 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    reason = {
        "flip": "checksum mismatch",
        "truncate": "checksum mismatch",
        "version": f"format version {snapshot.VERSION + 1}",
        "older": "format version 1",
    }
    with pytest.raises(SnapshotError, match=reason[damage]):
        snapshot.load(path)


def test_a_snapshot_that_does_not_hold_together_is_refused(
    model_dir: Path, tmp_path: Path, saved: tuple[Path, snapshot.SessionSnapshot]
) -> None:
    snap = snapshot.load(saved[0] / "s-1.snap")
    snap.header["chunks"][1]["original_start"] += 1  # a hole in the history
    fresh = manager(model_dir, tmp_path).session("s")
    with pytest.raises(SnapshotError, match="does not hold together"):
        snapshot.restore(snap, fresh, tmp_path)
    assert not fresh.chunks


def test_unchanged_resident_chunks_are_not_written_again(model_dir: Path, tmp_path: Path) -> None:
    s = manager(model_dir, tmp_path).session("s")
    conversation(s, 2)
    first = snapshot.save(s, tmp_path, "s-1.snap")
    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob(f"*{FILE_SUFFIX}")}
    second = snapshot.save(s, tmp_path, "s-2.snap")
    assert second.files == first.files
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob(f"*{FILE_SUFFIX}")} == mtimes
    header, _ = container.unpack((tmp_path / "s-2.snap").read_bytes(), snapshot.MAGIC, snapshot.VERSION)
    assert header["memory"]["history_tokens"] == len(s.history.token_ids())
