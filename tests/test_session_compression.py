"""K/V compression as a session setting: chunks sparsified once sealed, stored sparse when paged out,
restored bit-exact, never visible to a branch that shares the blocks, reported per token."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import Chunk, ChunkKind, ChunkState
from kvos.policy.compression import CompressionSpec, compression_name, parse_compression, parse_spec
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.pager import SavedKeys
from kvos.session.prompt import Span

CHUNK = 24
BLOCK = 8


def make_manager(
    model_dir: Path, spec: str, budget: int = 4096, disk: Path | None = None, mode: str = "sparse"
) -> MemoryManager:
    config = SessionConfig(
        store_disk_dir=disk,
        budget=Budget(max_active_tokens=budget, policy="hard"),
        chunk_tokens=CHUNK,
        embedder="tokens",
        recovery_signal="lexical",
        position_mode=mode,  # sparse: restores land at their own positions, K/V comparable bit for bit
        kv_compression=parse_compression(spec),
    )
    engine = Engine(load_model(model_dir), block_size=BLOCK)
    return MemoryManager(engine, load_tokenizer(model_dir), config)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_parse_compression_names_and_refusals(tmp_path: Path) -> None:
    assert parse_compression("none") is None and parse_compression(None) is None
    default = parse_compression("sparse")
    assert default is not None and default.budgets is None and default.sparsifier is not None
    sp = default.sparsifier
    assert (sp.k_scale, sp.v_scale, sp.key_unit, sp.n_sink) == (0.35, 0.17, "element", 64)
    sweet = parse_compression("sparse:sweet")
    assert sweet is not None and sweet.sparsifier is not None
    assert (sweet.sparsifier.k_scale, sweet.sparsifier.v_scale) == (0.45, 0.50)
    assert compression_name(sweet) == "sparse:sweet" and compression_name(None) == "none"
    # the spelling is checked without a file; the calibration is read when a model is named
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"kv_head_entropies": {"L0_K0": 1.0, "L0_K1": 3.0}}))
    both = parse_compression(f"sparse:sweet+entropy:{calibration}@0.25")
    assert both is not None and both.sparsifier is not None and both.budgets is not None
    assert dict(both.budgets.entropies) == {(0, 0): 1.0, (0, 1): 3.0} and both.budgets.keep == 0.25
    assert compression_name(both) == f"sparse:sweet+entropy:{calibration}@0.25"
    assert parse_spec("entropy") == CompressionSpec(entropy=True)
    assert parse_spec("entropy@0.3") == CompressionSpec(entropy=True, keep=0.3)
    assert str(parse_spec("entropy+sparse")) == "sparse:default+entropy"
    inverse = parse_compression(f"entropy-inverse:{calibration}@0.3")
    assert inverse is not None and inverse.budgets is not None and inverse.budgets.rule == "inverse"
    assert compression_name(inverse) == f"entropy-inverse:{calibration}@0.3"
    assert parse_spec("sparse:sweet+entropy-inverse") == CompressionSpec("sweet", True, rule="inverse")
    assert str(parse_spec("entropy-inverse@0.5")) == "entropy-inverse"
    with pytest.raises(ConfigError, match=r"need a calibration for .*run `kvos calibrate"):
        parse_compression("entropy", tmp_path / "model.gguf")
    with pytest.raises(ConfigError, match="not a kvos calibration file"):
        parse_compression(f"entropy:{tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="KEEP must be a fraction"):
        parse_spec("entropy@2")
    with pytest.raises(ConfigError, match="unknown sparsification preset 'loose'"):
        parse_compression("sparse:loose")
    for bad in (
        "zip", "entropy:", "sparse+sparse:sweet", "entropyx", "sparse+entropy+sparse",
        "entropy+entropy-inverse", "entropy-inverse:", "entropy-inversex", "entropy-",
    ):  # fmt: skip
        with pytest.raises(ConfigError, match="unknown --kv-compression"):
            parse_spec(bad)


def test_each_chunk_is_sparsified_once_prefilled_as_the_engine_would(model_dir: Path) -> None:
    """The session's cache equals a plain sequence prefilled chunk by chunk, each chunk thresholded right
    after its prefill by the sparsifier (tokens before position 64 untouched)."""
    ids = tokens(1, 5 * CHUNK + 7)
    manager = make_manager(model_dir, "sparse:sweet")
    session = manager.session("s")
    session.sync([Span(ids, ChunkKind.DOCUMENT)])
    method = manager.config.kv_compression.sparsifier if manager.config.kv_compression else None
    assert method is not None
    engine = Engine(load_model(model_dir), block_size=BLOCK)
    seq = engine.new_sequence()
    for lo in range(0, len(ids), CHUNK):
        part = ids[lo : lo + CHUNK]
        engine.extend(seq, part, range(lo, lo + len(part)))
        method.apply(engine.pool, seq.slots[lo:], torch.arange(lo, lo + len(part)))
    got, want = _cache(session.engine, session.pager.seq.slots), _cache(engine, seq.slots)
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    k0, v0 = got[0]
    assert not bool((k0[:64] == 0).any()) and not bool((v0[:64] == 0).any())  # sinks untouched
    assert bool((k0[64:] == 0).any()) and bool((v0[64:] == 0).any())
    assert all(c.compressed_tokens == c.num_tokens for c in session.chunks.values())
    stats = session.stats()
    assert stats["kv_compression"] == "sparse:sweet" and stats["compressed_chunks"] == 6
    assert 0.1 < stats["v_zero_fraction"] < 0.9


def _cache(engine: Engine, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [engine.pool.gather(layer, slots) for layer in range(engine.pool.layout.num_layers)]


def test_uncompressed_session_keeps_every_element(model_dir: Path) -> None:
    session = make_manager(model_dir, "none").session("s")
    session.sync([Span(tokens(1, 5 * CHUNK), ChunkKind.DOCUMENT)])
    k, v = _cache(session.engine, session.pager.seq.slots)[0]
    assert not bool((k == 0).any()) and not bool((v == 0).any())
    assert session.stats()["compressed_chunks"] == 0


def test_paged_out_chunks_are_stored_sparse_and_come_back_bit_exact(model_dir: Path) -> None:
    manager = make_manager(model_dir, "sparse:sweet")
    session = manager.session("s")
    session.sync([Span(tokens(2, 8 * CHUNK), ChunkKind.DOCUMENT)])
    victims = [c for c in session.chunks.values() if c.original_start >= 64]
    before = {c.chunk_id: session.engine.read_kv(session.pager.segments[c.chunk_id]) for c in victims}
    session.pager.evict(victims)
    store = session.pager.store
    assert store is not None
    stats = store.stats()
    assert stats["stored_bytes"] < 0.9 * stats["raw_bytes"]  # the zeros are not stored
    per_token = session.bytes_per_token()
    assert per_token["saved_bytes_per_token"] < 0.9 * per_token["resident_bytes_per_token"]
    for chunk in victims:
        session.pager.restore(chunk, at="place")
        k, v = session.engine.read_kv(session.pager.segments[chunk.chunk_id])
        assert torch.equal(k, before[chunk.chunk_id][0]) and torch.equal(v, before[chunk.chunk_id][1])
        assert chunk.compressed_tokens == chunk.num_tokens  # not sparsified a second time


def test_a_compacted_sessions_chunks_are_saved_as_sparse_as_chunks_that_never_moved(model_dir: Path) -> None:
    """Compact mode moves resident chunks down as others leave, so chunks are sealed and saved away from
    their logical positions. Keys zeroed element by element are saved in the frame they were thresholded
    in (the logical positions) with their zeros snapped back: the store holds as few bytes as for a session
    whose chunks never moved; without that, rotation turns half their zeros into rounding. A restored
    chunk's keys are the ones it left with, moved (within float32 rounding)."""
    ratios, left = {}, {}
    for mode, framed in (("sparse", True), ("compact", True), ("compact", False)):
        session = make_manager(model_dir, "sparse:sweet", budget=4 * CHUNK, mode=mode).session("s")
        frame = session.pager.saved_keys
        assert frame is not None
        if not framed:
            session.pager.saved_keys = None

        def keep(
            chunk: Chunk, positions: torch.Tensor, k: torch.Tensor, frame: SavedKeys = frame
        ) -> tuple[torch.Tensor, torch.Tensor]:
            left[chunk.chunk_id] = (positions.clone(), k.clone())
            return frame(chunk, positions, k)

        if framed:
            session.pager.saved_keys = keep
        session.sync([Span(tokens(9, 12 * CHUNK), ChunkKind.DOCUMENT)])
        saved = [c for c in session.chunks.values() if c.state is ChunkState.SAVED and c.original_start >= 64]
        store = session.pager.store
        assert store is not None and len(saved) >= 6
        if mode == "compact" and framed:  # they were moved, and are saved at their logical positions
            assert any(not torch.equal(left[c.chunk_id][0], _logical(c)) for c in saved)
            assert all(torch.equal(store.get(c.chunk_id).meta_int64("positions"), _logical(c)) for c in saved)
        stats = store.stats()
        ratios[mode, framed] = stats["stored_bytes"] / stats["raw_bytes"]
        if mode == "compact" and framed:
            chunk = saved[len(saved) // 2]
            session.pager.restore(chunk, at="end")
            seg = session.pager.segments[chunk.chunk_id]
            k, _ = session.engine.read_kv(seg)
            was_at, was = left[chunk.chunk_id]
            want = session.engine.model.ropes.reanchor(was, was_at, seg.positions)
            torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-5)
    assert ratios["sparse", True] < 0.85
    assert abs(ratios["compact", True] - ratios["sparse", True]) < 0.02
    assert ratios["compact", False] > ratios["compact", True] + 0.05


def test_chunks_sparsified_before_a_switch_are_still_saved_in_their_frame(model_dir: Path) -> None:
    """A session switched from sparse to none keeps the zeros it made: its sparsified chunks that moved are
    saved as sparse as before the switch, and the chunks sealed after it are not sparsified."""
    ratios = {}
    for switch in (False, True):
        session = make_manager(model_dir, "sparse:sweet", budget=4 * CHUNK, mode="compact").session("s")
        session.sync([Span(tokens(9, 4 * CHUNK), ChunkKind.DOCUMENT)])  # sealed while all fits
        if switch:
            session.set_compression("none")
        session.sync([Span(tokens(9, 4 * CHUNK) + tokens(10, 8 * CHUNK), ChunkKind.DOCUMENT)])
        early = [c for c in session.chunks.values() if 64 <= c.original_start < 4 * CHUNK]
        late = [c for c in session.chunks.values() if c.original_start >= 4 * CHUNK]
        assert all(c.compressed_tokens == c.num_tokens for c in early)
        assert all(bool(c.compressed_tokens) != switch for c in late)
        store = session.pager.store
        assert store is not None
        saved = [c for c in early if c.state is ChunkState.SAVED]
        assert saved and all(
            torch.equal(store.get(c.chunk_id).meta_int64("positions"), _logical(c)) for c in saved
        )
        k = torch.cat([store.get(c.chunk_id).k for c in saved], dim=1)
        ratios[switch] = float((k == 0).float().mean())
    assert ratios[True] == ratios[False] > 0.2


def _logical(chunk: Chunk) -> torch.Tensor:
    return torch.arange(chunk.original_start, chunk.original_end, dtype=torch.int64)


def test_sealing_a_shared_chunk_leaves_the_branch_its_own_blocks(model_dir: Path) -> None:
    """The generation prompt's ASSISTANT chunk is not sealed (the reply continues it); a branch forked
    then shares its blocks, and when the parent seals it the branch still reads the dense K/V."""
    manager = make_manager(model_dir, "sparse")
    parent = manager.session("main")
    doc, header = tokens(3, 4 * CHUNK), tokens(4, 2 * BLOCK)
    parent.sync([Span(doc, ChunkKind.DOCUMENT), Span(header, ChunkKind.ASSISTANT, message_index=1)])
    last = parent.history.last()
    assert last is not None and last.kind is ChunkKind.ASSISTANT and last.compressed_tokens == 0
    child = manager.fork("main", "branch", len(doc) + len(header))
    child_last = child.chunks[last.chunk_id]
    dense = child.engine.read_kv(child.pager.segments[last.chunk_id])
    used = manager.engine.pool.allocator.num_used
    parent.seal(last)
    assert manager.engine.pool.allocator.num_used == used + 2  # the shared blocks copied, then edited
    assert last.compressed_tokens == len(header) and child_last.compressed_tokens == 0
    k_child, v_child = child.engine.read_kv(child.pager.segments[last.chunk_id])
    assert torch.equal(k_child, dense[0]) and torch.equal(v_child, dense[1])
    k_parent, _ = parent.engine.read_kv(parent.pager.segments[last.chunk_id])
    assert bool((k_parent == 0).any()) and not torch.equal(k_parent, dense[0])
    child.seal(child_last)  # the same chunk in the same state: the same zeros
    k_child, v_child = child.engine.read_kv(child.pager.segments[last.chunk_id])
    assert torch.equal(k_child, k_parent)


def test_reply_chunks_are_sealed_as_they_fill_and_when_the_reply_ends(model_dir: Path) -> None:
    from kvos.engine.sampling import SamplingParams

    session = make_manager(model_dir, "sparse").session("s")
    session.sync([Span(tokens(5, 4 * CHUNK), ChunkKind.DOCUMENT)])
    for _ in session.reply(SamplingParams(max_tokens=2 * CHUNK + 5, temperature=0.0)):
        pass
    replies = [c for c in session.chunks.values() if c.kind is ChunkKind.ASSISTANT]
    assert replies and all(c.compressed_tokens == c.num_tokens for c in replies)
    assert sum(c.num_tokens for c in replies) == 2 * CHUNK + 5


def test_served_sessions_report_what_compression_saves(model_dir: Path) -> None:
    """`kvos serve --kv-compression sparse:sweet` at its own defaults but a small budget: a conversation
    that pages out reports fewer bytes per saved token than per resident one, in usage, /v1/sessions and
    /metrics."""
    import httpx
    from server_harness import MODEL_NAME, running_server

    budget = 256
    with running_server(model_dir, "--kv-compression", "sparse:sweet", budget=budget) as url:
        messages = [{"role": "system", "content": "You are a terse assistant. " * 4}]
        for turn in range(12):
            messages.append({"role": "user", "content": f"message {turn}: " + "waves and wind and salt " * 5})
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": "c"}, timeout=60)
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        usage = r.json()["usage"]["kvos"]
        stats = next(s for s in httpx.get(f"{url}/sessions").json()["data"] if s["id"] == "c")
        metrics = httpx.get(url.replace("/v1", "/metrics")).text
    assert stats["evictions"] > 0 and stats["kv_compression"] == "sparse:sweet"
    assert 0 < usage["saved_bytes_per_token"] < 0.9 * usage["resident_bytes_per_token"]
    assert stats["saved_bytes_per_token"] == usage["saved_bytes_per_token"]
    assert stats["compressed_chunks"] > 0 and stats["k_zero_fraction"] > 0.05
    assert 'kvos_session_saved_bytes_per_token{session="' in metrics


def test_serve_refuses_an_unknown_compression(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --kv-compression stops `kvos serve` as its arguments are read, with the reason, before any model
    is loaded."""
    import argparse

    from kvos.server.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for spec, why in (("entropy@0", "KEEP must be a fraction"), ("sparse:tight", "unknown sparsification")):
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(["--model", str(model_dir), "--kv-compression", spec])
        assert stopped.value.code == 2 and why in capsys.readouterr().err
    assert parser.parse_args(["--kv-compression", "sparse:sweet"]).kv_compression == "sparse:sweet"
    spec = "sparse+entropy:cal.json@0.4"  # the spelling only: the file is read with the model
    assert parser.parse_args(["--kv-compression", spec]).kv_compression == spec


def test_a_request_sets_its_sessions_compression(model_dir: Path) -> None:
    """`"kvos": {"kv_compression": ...}` on a server started without compression: that session compresses
    from then on, another does not; a bad value is a 400 naming the field and changes nothing."""
    import httpx
    from server_harness import MODEL_NAME, running_server

    with running_server(model_dir) as url:

        def ask(sid: str, kvos: dict[str, str] | None = None) -> httpx.Response:
            body: dict[str, object] = {
                "model": MODEL_NAME,  # each session its own text: a shared prefix would share the K/V
                "messages": [{"role": "user", "content": f"{sid}: the tide and the moon " * 30}],
                "max_tokens": 4,
            }
            if kvos is not None:
                body["kvos"] = kvos
            return httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=60)

        bad = ask("a", {"kv_compression": "sparse:tight"})
        assert (
            bad.status_code == 400 and "kv_compression" in bad.text and "unknown sparsification" in bad.text
        )
        assert ask("a", {"kv_compression": "sparse:sweet"}).status_code == 200
        assert ask("b").status_code == 200
        rows = {s["id"]: s for s in httpx.get(f"{url}/sessions").json()["data"]}
    assert rows["a"]["kv_compression"] == "sparse:sweet" and rows["a"]["compressed_chunks"] > 0
    assert rows["b"]["kv_compression"] == "none" and rows["b"]["compressed_chunks"] == 0


def test_a_sessions_compression_survives_a_snapshot(model_dir: Path, tmp_path: Path) -> None:
    from kvos.session import snapshot

    manager = make_manager(model_dir, "none", disk=tmp_path)
    session = manager.session("s")
    session.set_compression("sparse:aggressive")
    session.sync([Span(tokens(6, 4 * CHUNK), ChunkKind.DOCUMENT)])
    snap = snapshot.save(session, tmp_path, "s.snap")
    fresh = make_manager(model_dir, "none", disk=tmp_path).session("s")
    snapshot.restore(snapshot.load(tmp_path / "s.snap"), fresh, tmp_path)
    assert snap.header["session"]["kv_compression"] == "sparse:aggressive"
    assert fresh.stats()["kv_compression"] == "sparse:aggressive"


def test_the_learned_signals_codes_come_from_the_keys_before_sparsification(model_dir: Path) -> None:
    """A chunk's key code is what the uncompressed session makes for it: the retriever was calibrated on
    the keys the model writes, so the code is taken before the zeros go in; a reply that continues the
    generation prompt's chunk gets a code of the whole chunk, not of the prompt's few tokens."""
    from test_retriever import random_retriever

    from kvos.engine.sampling import SamplingParams

    c = load_model(model_dir).config
    width = len((0,)) * c.num_kv_heads * c.head_dim
    sessions = {}
    for spec in ("none", "sparse:aggressive"):
        manager = make_manager(model_dir, spec)
        manager.config.retriever = random_retriever(c.num_heads * c.head_dim, (0,), width)
        manager.config.recovery_signal = "learned"
        session = manager.session("s")
        ids = tokens(7, 4 * CHUNK)
        session.sync(
            [Span(ids, ChunkKind.DOCUMENT), Span(tokens(8, 3), ChunkKind.ASSISTANT, message_index=1)]
        )
        for _ in session.reply(SamplingParams(max_tokens=CHUNK - 3, temperature=0.0, ignore_eos=True)):
            pass
        sessions[spec] = session
    plain, sparse = sessions["none"], sessions["sparse:aggressive"]
    assert sparse.stats()["compressed_chunks"] > 0
    late = [c for c in sparse.chunks.values() if c.original_start >= 64 and c.kind is ChunkKind.DOCUMENT]
    for chunk in late:
        assert chunk.key_code is not None
        assert torch.equal(chunk.key_code, plain.pager.key_codes([plain.chunks[chunk.chunk_id]])[0])
    reply = sparse.history.last()
    assert reply is not None and reply.num_tokens == CHUNK and reply.key_code is not None
    assert reply.key_code.shape[0] == CHUNK


def test_a_shared_chunk_stays_whole_when_the_pool_has_no_block_for_a_copy(model_dir: Path) -> None:
    """At the pool's cap the copy-on-write cannot take a block: the chunk is left as it is (neither side's
    K/V change) and sealed at a later seal, once a block is free."""
    from kvos.errors import PoolOutOfMemoryError

    manager = make_manager(model_dir, "sparse")
    parent = manager.session("main")
    doc, header = tokens(3, 4 * CHUNK), tokens(4, 2 * BLOCK)
    parent.sync([Span(doc, ChunkKind.DOCUMENT), Span(header, ChunkKind.ASSISTANT, message_index=1)])
    last = parent.history.last()
    assert last is not None
    child = manager.fork("main", "branch", len(doc) + len(header))
    dense = parent.engine.read_kv(parent.pager.segments[last.chunk_id])
    pool = manager.engine.pool
    pool.growth = replace(pool.growth, max_bytes=pool.nbytes)  # the pool at its cap, every block taken
    taken = pool.allocator.alloc_n(pool.allocator.num_free)
    with pytest.raises(PoolOutOfMemoryError):
        pool.alloc_n(1)
    sealed = parent.stats()["compressed_chunks"]
    parent.seal(last)
    assert last.compressed_tokens == 0 and parent.stats()["compressed_chunks"] == sealed
    for session in (parent, child):
        k, v = session.engine.read_kv(session.pager.segments[last.chunk_id])
        assert torch.equal(k, dense[0]) and torch.equal(v, dense[1])
    for block in taken:
        pool.free(block)
    parent.seal(last)
    assert last.compressed_tokens == len(header)
    k, _ = parent.engine.read_kv(parent.pager.segments[last.chunk_id])
    assert bool((k == 0).any())


def test_a_cut_chunk_keeps_only_what_it_holds(model_dir: Path) -> None:
    """A truncation or a branch cut inside a sealed chunk: its count of compressed tokens and its key code
    no longer cover tokens it does not hold (a code of the whole chunk would score the cut tokens)."""
    from test_retriever import random_retriever

    c = load_model(model_dir).config
    manager = make_manager(model_dir, "sparse")
    manager.config.retriever = random_retriever(c.num_heads * c.head_dim, (0,), c.num_kv_heads * c.head_dim)
    manager.config.recovery_signal = "learned"
    session = manager.session("s")
    session.sync([Span(tokens(9, 5 * CHUNK), ChunkKind.DOCUMENT)])
    chunk = max(session.chunks.values(), key=lambda x: x.original_start)
    assert chunk.compressed_tokens == CHUNK and chunk.key_code is not None
    child = manager.fork("s", "branch", chunk.original_start + 10)
    cut = child.chunks[chunk.chunk_id]
    assert cut.num_tokens == 10 and cut.compressed_tokens == 10 and cut.key_code is None
    assert child.pager.key_codes([cut])[0].shape[0] == 10  # type: ignore[union-attr]
    session.truncate(chunk.original_start + 5)
    assert chunk.num_tokens == 5 and chunk.compressed_tokens == 5 and chunk.key_code is None
