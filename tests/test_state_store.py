"""The pieces under ``--state-dir``, in process: the write-through chunk store, the state directory (what a
crash leaves, other models' state, the start-up sweep) and prefix routing to a stored session."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_harness import MODEL_NAME, running_server

from kvos.builtin import MODEL_DIR
from kvos.engine.engine import Engine
from kvos.engine.sampling import SamplingParams
from kvos.errors import ChunkDataError, ConfigError, CorruptChunkError
from kvos.memory.store import FILE_SUFFIX, ChunkStore, read_chunk_file
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkKind
from kvos.server.layout import MANIFEST
from kvos.server.state import StateDir
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
FILLER = "the quick brown fox jumps over the lazy dog while it rains "


def chunk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 2, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g)


def test_write_through_store_writes_at_put_and_releases_files(tmp_path: Path) -> None:
    released: list[Path] = []
    store = ChunkStore(0, tmp_path, write_through=True, release=released.append)  # nothing stays in RAM
    k, v = chunk(1)
    store.put("a", k, v, {"positions": [0, 1, 2, 3, 4]})
    path = store.file_of("a")
    assert path is not None and store.where("a") == "disk"
    on_disk = read_chunk_file(path)
    assert (
        torch.equal(on_disk.k, k)
        and torch.equal(on_disk.v, v)
        and on_disk.meta["positions"] == [0, 1, 2, 3, 4]
    )
    got = store.get("a")  # read back (it fits no RAM): the file stays the entry's
    assert torch.equal(got.k, k) and store.file_of("a") == path
    store.delete("a")
    assert released == [path] and path.exists()  # the caller decides what happens to a released file

    ram = ChunkStore(None, tmp_path / "ram", write_through=True)
    ram.put("b", *chunk(2))
    assert ram.where("b") == "ram" and ram.file_of("b") is not None  # in RAM and on disk at once


def test_adopted_files_are_checked(tmp_path: Path) -> None:
    writer = ChunkStore(None, tmp_path, write_through=True, release=lambda _: None)
    for i in range(3):
        writer.put(i, *chunk(i), {"positions": list(range(5))})
    paths = [writer.file_of(i) for i in range(3)]
    assert all(p is not None for p in paths)
    good, flipped, cut = (p for p in paths if p is not None)
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0x40
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-10])

    reader = ChunkStore(None, tmp_path, write_through=True)
    reader.adopt("good", good)
    assert torch.equal(reader.get("good").k, chunk(0)[0])
    reader.adopt("flipped", flipped)  # its prefix and size are right: the digest is checked when read
    with pytest.raises(CorruptChunkError, match="checksum mismatch"):
        reader.get("flipped")
    assert reader.take_dropped() == ["flipped"] and "flipped" not in reader
    with pytest.raises(ChunkDataError, match="payload is"):
        reader.adopt("cut", cut)
    with pytest.raises(ConfigError, match="files in its disk_dir"):
        ChunkStore(None, tmp_path / "other", write_through=True).adopt("good", good)


def manager(model_dir: Path, state: StateDir | None = None) -> MemoryManager:
    config = SessionConfig(budget=Budget(160), chunk_tokens=24, recovery_signal="lexical")
    factory = state.store_factory if state is not None else None
    engine = Engine(load_model(model_dir), block_size=8)
    return MemoryManager(engine, load_tokenizer(model_dir), config, store_factory=factory)


def state_dir(root: Path, model_dir: Path, ttl: float = 3600.0) -> StateDir:
    m = manager(model_dir)
    return StateDir.for_model(root, m.engine.model, m.tokenizer, m.config, ttl)


def test_after_a_crash_the_last_snapshot_comes_back(model_dir: Path, tmp_path: Path) -> None:
    state = state_dir(tmp_path, model_dir)
    s = manager(model_dir, state).session("local/s")
    s.add_message("system", "You keep notes.")
    for i in range(4):
        s.add_message("user", f"note {i}: " + FILLER)
        s.generate(GREEDY)
    assert state.save("local", "s", 4, [s]) and not state.save("local", "s", 4, [s])  # unchanged: skipped
    saved_history = s.history.token_ids()
    for i in range(4, 7):  # after the snapshot: evicted chunks are written, then the process dies
        s.add_message("user", f"note {i}: " + FILLER)
        s.generate(GREEDY)
    branch = state.layout.branch_dir("local/s")
    orphans = {p.name for p in branch.iterdir()}

    again = state_dir(tmp_path, model_dir)  # the restarted server
    loaded = again.load("local", "s", manager(model_dir, again))
    assert loaded is not None
    (restored,), served = loaded
    assert served == 4 and restored.history.token_ids() == saved_history and restored.swapped
    assert orphans - {p.name for p in branch.iterdir()}  # files written after the snapshot: deleted
    restored.swap_in()
    synced = restored.sync([Span(s.history.token_ids(), ChunkKind.DOCUMENT)])
    assert synced.reused == len(saved_history)  # the rest is prefilled again
    assert synced.decoded == len(s.history.token_ids()) - len(saved_history)


def test_branches_come_back_in_their_order(model_dir: Path, tmp_path: Path) -> None:
    state = state_dir(tmp_path, model_dir)
    m = manager(model_dir, state)
    main = m.session("local/s")
    for i in range(4):
        main.add_message("user", f"note {i}: " + FILLER)
    side = m.fork("local/s", "local/s#b3", main.history.tokens // 2)  # shares resident chunks
    side.add_message("user", "a side question")
    assert state.save("local", "s", 3, [side, main])

    again = state_dir(tmp_path, model_dir)
    loaded = again.load("local", "s", manager(model_dir, again))
    assert loaded is not None
    branches, served = loaded
    assert served == 3 and [b.session_id for b in branches] == ["local/s#b3", "local/s"]
    for restored, live in zip(branches, (side, main), strict=True):
        assert restored.history.token_ids() == live.history.token_ids()
        restored.swap_in()  # each branch gets its own copy of what the live ones share
        for cid in live.pager.order():
            k, v = live.engine.read_kv(live.pager.segments[cid])
            k2, v2 = restored.engine.read_kv(restored.pager.segments[cid])
            assert torch.equal(k, k2) and torch.equal(v, v2)


def test_state_of_another_model_is_ignored(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mine = state_dir(tmp_path, model_dir)
    s = manager(model_dir, mine).session("local/s")
    s.add_message("user", "hello " + FILLER)
    mine.save("local", "s", 1, [s])
    with caplog.at_level(logging.INFO, logger="kvos.server.state"):
        other = state_dir(tmp_path, MODEL_DIR)
    assert other.base != mine.base
    assert f"ignoring {mine.base.name}, the state of another model or settings" in caplog.text
    assert other.load("local", "s", manager(MODEL_DIR, other)) is None


def test_start_up_sweeps_unfinished_and_expired_sessions(model_dir: Path, tmp_path: Path) -> None:
    state = state_dir(tmp_path, model_dir)
    m = manager(model_dir, state)
    for sid in ("kept", "old", "unfinished"):
        s = m.session(f"local/{sid}")
        for i in range(3):
            s.add_message("user", f"{i} " + FILLER)  # evictions write chunk files at once
        if sid != "unfinished":  # it ended before its first snapshot: chunk files, no manifest
            state.save("local", sid, 1, [s])
    old = state.layout.entry_dir("local", "old") / MANIFEST
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert any(state.layout.branch_dir("local/unfinished").glob(f"*{FILE_SUFFIX}"))
    state_dir(tmp_path, model_dir, ttl=3600.0)
    kept = state.layout.entry_dir("local", "kept")
    assert list(kept.parent.iterdir()) == [kept]
    state.forget("local", "kept")
    assert not any(state.base.joinpath("local").iterdir())


def test_a_request_without_session_id_finds_its_stored_session(model_dir: Path, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "hello there"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
    with running_server(model_dir, "--state-dir", str(tmp_path)) as url:
        first = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
        (listed,) = httpx.get(f"{url}/sessions", timeout=30).json()["data"]
    reply = first.json()["choices"][0]["message"]["content"]
    body["messages"] = [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "more"},
    ]
    with running_server(model_dir, "--state-dir", str(tmp_path)) as url:  # written at shutdown, read back
        second = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
        sid = second.headers["x-session-id"]
        assert sid == first.headers["x-session-id"]
        assert second.json()["usage"]["kvos"]["reused_tokens"] == listed["history_tokens"]
    with running_server(model_dir, "--state-dir", str(tmp_path)) as url:  # deleted before it is loaded
        assert httpx.delete(f"{url}/sessions/{sid}", timeout=30).status_code == 200
        assert httpx.delete(f"{url}/sessions/{sid}", timeout=30).status_code == 404
    assert not any(tmp_path.glob("*/local/*"))


def test_state_dir_needs_kv_restore(model_dir: Path, tmp_path: Path) -> None:
    options = ["--state-dir", str(tmp_path), "--backend", "breadcrumb"]
    with pytest.raises(SystemExit, match="needs --backend kv_restore"), running_server(model_dir, *options):
        pass
    options = ["--store", "valkey://127.0.0.1:1/0", "--backend", "breadcrumb"]
    with pytest.raises(SystemExit, match="--store keeps saved K/V"), running_server(model_dir, *options):
        pass
    with (
        pytest.raises(SystemExit, match="expected valkey://"),
        running_server(model_dir, "--store", "http://x"),
    ):
        pass
