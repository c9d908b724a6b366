"""Per-head entropy budgets as a session setting (``--kv-compression entropy``): each sealed chunk's KV heads
keep their own budgets of its tokens, chosen from the observation window's attention as an engine sequence
would; the dropped tokens' K/V leave the pool; such chunks page out and in, are saved and restored, bit for
bit, with which tokens each head holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvos.engine.engine import Engine
from kvos.engine.head_segments import compress_heads, read_heads
from kvos.engine.sampling import SamplingParams
from kvos.engine.sequence import Segment, Sequence
from kvos.errors import ConfigError
from kvos.memory.store import ChunkStore
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.budgeted import compress_prompt
from kvos.policy.chunks import ChunkKind, ChunkState
from kvos.policy.compression import Compression, parse_compression
from kvos.policy.token_select import observed_keep
from kvos.session import snapshot
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span
from kvos.session.session import Session

CHUNK = 32
BLOCK = 8
WINDOW = 32  # the session's observation window (Pager.append)


def make_manager(
    model_dir: Path, spec: str, budget: int = 4096, mode: str = "sparse", disk: Path | None = None
) -> MemoryManager:
    config = SessionConfig(
        budget=Budget(max_active_tokens=budget, policy="hard"),
        chunk_tokens=CHUNK,
        embedder="tokens",
        recovery_signal="lexical",
        position_mode=mode,  # type: ignore[arg-type]
        kv_compression=parse_compression(spec),
    )
    engine = Engine(load_model(model_dir), block_size=BLOCK)
    store = (lambda _: ChunkStore(disk_dir=disk, write_through=True)) if disk is not None else None
    return MemoryManager(engine, load_tokenizer(model_dir), config, store_factory=store)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def varied_calibration(tmp_path: Path) -> Path:
    """A calibration whose heads are far apart (the small random model's own entropies are alike)."""
    path = tmp_path / "entropy.json"
    entropies = {"L0_K0": 0.4, "L0_K1": 4.0, "L1_K0": 2.0, "L1_K1": 2.4}
    path.write_text(json.dumps({"kv_head_entropies": entropies}))
    return path


def reference(manager: MemoryManager, model_dir: Path) -> tuple[Compression, Engine, Sequence]:
    """The manager's compression, and a fresh engine and sequence of the same model to replay a session on."""
    method = manager.config.kv_compression
    assert method is not None and method.budgets is not None
    engine = Engine(load_model(model_dir), block_size=BLOCK)
    return method, engine, engine.new_sequence()


def replied(session: Session, params: SamplingParams) -> list[int | None]:
    return [event.token_id for event in session.reply(params)]


def kv_of(session: Session, seg: Segment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if seg.heads is None:
        return (*session.engine.read_kv(seg), None)
    return read_heads(session.engine, seg)


@pytest.mark.parametrize("word", ["entropy", "entropy-inverse"])
def test_each_sealed_chunk_keeps_its_heads_budgets_as_an_engine_sequence_would(
    model_dir: Path, tmp_path: Path, word: str
) -> None:
    """The session's cache equals a plain sequence prefilled chunk by chunk where each chunk waits for the
    queries that read it next: the next prefilled chunk of 8 tokens or more (its last 32 queries, all of a
    shorter one), else the reply's decode steps until 32 queries have seen it; then its heads keep their
    budgets of its tokens, the sinks and the best of those queries' mean attention (:func:`observed_keep`).
    The logits agree, and the dropped K/V are out of the pool."""
    calibration = varied_calibration(tmp_path)
    manager = make_manager(model_dir, f"{word}:{calibration}@0.5")
    session = manager.session("s")
    ids = tokens(1, 4 * CHUNK + 12)
    session.sync([Span(ids, ChunkKind.DOCUMENT)])
    method, engine, seq = reference(manager, model_dir)
    lay, layers = engine.pool.layout, frozenset(range(engine.pool.layout.num_layers))
    heads = engine.model.config.num_heads
    waiting: list[tuple[int, Segment, int, list[torch.Tensor], list[int]]] = []  # id, seg, start, sums, seen
    expected: dict[int, tuple[list[list[int]], list[int]]] = {}

    def observe(captured: dict[int, torch.Tensor], queries: int) -> None:
        for item in list(waiting):
            cid, seg, lo, sums, seen = item
            n = seg.num_tokens
            for layer, total in enumerate(sums):
                total += queries * captured[layer][:, lo : lo + n].float()
            seen[0] += queries
            if queries >= 8 or seen[0] >= WINDOW:
                waiting.remove(item)
                budgets = method.budgets.for_chunk(n, lay.num_layers, lay.num_kv_heads, BLOCK)
                probs = [total / seen[0] for total in sums]
                keep = observed_keep(probs, budgets, lay.num_kv_heads, max(0, 4 - lo))
                compress_heads(engine, seq, seg, keep)
                expected[cid] = (keep, budgets)

    for chunk in sorted(session.chunks.values(), key=lambda c: c.original_start):
        lo, n = chunk.original_start, chunk.num_tokens
        seg = seq.open_segment()
        captured: dict[int, torch.Tensor] = {}
        logits = engine.extend(seq, chunk.token_ids, range(lo, lo + n), "last", layers, captured, WINDOW)
        observe(captured, min(WINDOW, n))
        waiting.append((chunk.chunk_id, seg, lo, [torch.zeros(heads, n) for _ in layers], [0]))

    # chunks 0-2 were read by a whole window, chunk 3 by all 12 queries of the last, which nothing read yet
    assert len(expected) == 4 and [w[0] for w in waiting] == [c.chunk_id for c in session.chunks.values()][4:]
    assert session.last_logits is not None
    torch.testing.assert_close(session.last_logits, logits, rtol=0, atol=1e-5)
    assert [session.pager.segments[w[0]].heads for w in waiting] == [None]
    pool = session.engine.pool
    held = sum(-(-len(row) // BLOCK) for keep, _ in expected.values() for row in keep)
    assert pool.head_store().num_used == held

    # the reply reads the last: it is chosen after 32 decode steps (the reply's own
    # chunks stay whole here, so that the replay need not cut them: the next test does)
    session.compressor.kinds = frozenset({"document"})
    params = SamplingParams(max_tokens=WINDOW + 3, temperature=0.0, ignore_eos=True)
    reply = [t for t in replied(session, params) if t is not None]
    seq.open_segment()
    position = len(ids)
    for token in reply[:WINDOW]:
        captured = {}
        engine.extend(seq, [token], [position], "last", layers, captured)
        position += 1
        observe(captured, 1)
    assert not waiting and len(expected) == 5

    for cid, (keep, budgets) in expected.items():
        ours = session.pager.segments[cid]
        theirs = seq.segments[sorted(expected).index(cid)]
        assert ours.heads is not None and theirs.heads is not None
        assert [row.tolist() for row in ours.heads.kept] == keep
        assert [len(row) for row in keep] == budgets
        k1, v1, m1 = read_heads(session.engine, ours)
        k2, v2, m2 = read_heads(engine, theirs)
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(m1, m2)
    first = session.pager.segments[min(expected)].heads
    assert first is not None and all(row[:4].tolist() == [0, 1, 2, 3] for row in first.kept)  # the sinks

    # the budgets differ per head, average half a chunk, and what was dropped left the pool
    full = expected[min(expected)][1]
    assert len(set(full)) > 1 and sum(full) <= lay.num_layers * lay.num_kv_heads * CHUNK // 2
    docs = [cid for cid in expected if session.chunks[cid].kind is ChunkKind.DOCUMENT]
    assert len(docs) == 5 and all(session.pager.segments[cid].heads is not None for cid in docs)
    stats = session.stats()
    assert stats["head_chunks"] == 5 and stats["kv_compression"] == f"{word}:{calibration}"
    # the seed's rule gives the diffuse head of layer 0 (4.0 bits) more than the focused one (0.4), the
    # inverse rule the other way round
    first, second = full[0], full[1]
    assert (first < second) if word == "entropy" else (first > second)


def test_a_reply_chunk_is_chosen_by_its_own_decode_attention(model_dir: Path, tmp_path: Path) -> None:
    """A reply chunk's heads choose when it is sealed, by the mean attention each of its tokens got from the
    decode steps that wrote the chunk (its own observation window), as a plain sequence decoding the same
    tokens and cutting each chunk then would; the user's messages stay whole."""
    manager = make_manager(model_dir, f"entropy:{varied_calibration(tmp_path)}")
    session = manager.session("s")
    session.add_message("user", "the lanterns are in crate 7; " * 3)
    _, reply, _ = session.generate(SamplingParams(max_tokens=2 * CHUNK + 5, temperature=0.0, ignore_eos=True))
    chunks = sorted(session.chunks.values(), key=lambda c: c.original_start)
    answers = [c for c in chunks if c.kind is ChunkKind.ASSISTANT]
    assert len(answers) == 3 and sum(c.num_tokens for c in answers) > len(reply)
    assert all(
        session.pager.segments[c.chunk_id].heads is None for c in chunks if c.kind is not ChunkKind.ASSISTANT
    )

    method, engine, seq = reference(manager, model_dir)
    lay, layers = engine.pool.layout, frozenset(range(engine.pool.layout.num_layers))
    header = sum(c.num_tokens for c in answers) - len(reply)  # the generation prompt's tokens, prefilled
    for chunk in chunks[: chunks.index(answers[0])]:
        seq.open_segment()
        engine.extend(seq, chunk.token_ids, range(chunk.original_start, chunk.original_end), "none")
    fed = list(answers[0].token_ids[:header]) + list(reply)
    seg, position = seq.open_segment(), answers[0].original_start
    engine.extend(seq, fed[:header], range(position, position + header), "none")
    kept: list[list[list[int]] | None] = []
    sums, counts = [torch.zeros(engine.model.config.num_heads, CHUNK) for _ in layers], torch.zeros(CHUNK)

    def cut() -> None:
        n = seg.num_tokens
        means = [total[:, :n] / counts[:n] for total in sums]
        budgets = method.budgets.for_chunk(n, lay.num_layers, lay.num_kv_heads, BLOCK)
        keep = observed_keep(means, budgets, lay.num_kv_heads, 0)
        full = all(len(row) == n for row in keep)
        if not full:
            compress_heads(engine, seq, seg, keep)
        kept.append(None if full else keep)

    position += header
    for token in fed[header:]:
        if seg.num_tokens >= CHUNK:  # the writer seals a full chunk before it writes the next token
            cut()
            seg, counts = seq.open_segment(), torch.zeros(CHUNK)
            sums = [torch.zeros(engine.model.config.num_heads, CHUNK) for _ in layers]
        captured: dict[int, torch.Tensor] = {}
        engine.extend(seq, [token], [position], "last", layers, captured)
        position, n = position + 1, seg.num_tokens
        for layer, total in enumerate(sums):
            total[:, :n] += captured[layer][:, -n:].float()
        counts[:n] += 1
    cut()
    assert any(keep is not None for keep in kept)
    for chunk, keep in zip(answers, kept, strict=True):
        heads = session.pager.segments[chunk.chunk_id].heads
        assert (
            (heads is None)
            if keep is None
            else (heads is not None and [r.tolist() for r in heads.kept] == keep)
        )


@pytest.mark.parametrize("mode", ["sparse", "compact"])
def test_a_per_head_chunk_pages_out_sparse_and_comes_back_as_it_was(
    model_dir: Path, head_calibration: Path, mode: str
) -> None:
    """Paged out, a chunk whose heads keep their own tokens is stored with its head mask and its dropped
    K/V as zeros, which the store does not keep; back in, each head holds the same tokens, the same K/V
    (re-anchored where compaction moved them), and the session decodes as one that never paged out."""
    manager = make_manager(model_dir, f"entropy:{head_calibration}", mode=mode)
    paged, kept = manager.session("paged"), manager.session("kept")
    ids = tokens(4, 5 * CHUNK)
    for s in (paged, kept):
        s.sync([Span(ids, ChunkKind.DOCUMENT)])
    victims = [c for c in paged.chunks.values() if 2 * CHUNK <= c.original_start < 4 * CHUNK]
    before = {c.chunk_id: kv_of(paged, paged.pager.segments[c.chunk_id]) for c in victims}
    paged.memory.page_out(victims)
    store = paged.pager.store
    assert store is not None and all(c.state is ChunkState.SAVED for c in victims)
    assert all("head_mask" in store.meta(c.chunk_id) for c in victims)
    stats = store.stats()
    assert stats["stored_bytes"] < 0.7 * stats["raw_bytes"]  # the dropped K/V are not stored
    for chunk in victims:
        paged.pager.restore(chunk, at="place")
    if mode == "compact":
        paged.pager.compact()
    for chunk in victims:
        k, v, mask = kv_of(paged, paged.pager.segments[chunk.chunk_id])
        k0, v0, mask0 = before[chunk.chunk_id]
        assert mask is not None and mask0 is not None and torch.equal(mask, mask0)
        assert torch.equal(v, v0)
        assert torch.equal(k, k0) if mode == "sparse" else torch.allclose(k, k0, atol=1e-5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert replied(paged, params) == replied(kept, params)


def test_a_waiting_chunk_that_must_leave_is_chosen_by_its_own_last_queries(
    model_dir: Path, head_calibration: Path
) -> None:
    """A chunk paged out before 32 queries read it is cut first, so that it is saved at its budget: by the
    queries that read it so far, or by its own prefill's last queries when none did yet."""
    manager = make_manager(model_dir, f"entropy:{head_calibration}")
    session = manager.session("s")
    ids = tokens(8, 2 * CHUNK)
    session.sync([Span(ids, ChunkKind.DOCUMENT)])
    first, last = sorted(session.chunks.values(), key=lambda c: c.original_start)
    assert session.pager.segments[first.chunk_id].heads is not None
    assert session.pager.segments[last.chunk_id].heads is None  # waiting
    session.memory.page_out([last])
    store = session.pager.store
    assert store is not None and "head_mask" in store.meta(last.chunk_id)
    session.pager.restore(last, at="place")

    method, engine, seq = reference(manager, model_dir)
    lay, layers = engine.pool.layout, frozenset(range(engine.pool.layout.num_layers))
    for lo in (0, CHUNK):
        seq.open_segment()
        captured: dict[int, torch.Tensor] = {}
        engine.extend(seq, ids[lo : lo + CHUNK], range(lo, lo + CHUNK), "none", layers, captured, WINDOW)
    budgets = method.budgets.for_chunk(CHUNK, lay.num_layers, lay.num_kv_heads, BLOCK)
    probs = [captured[i][:, CHUNK:] for i in range(lay.num_layers)]
    keep = observed_keep(probs, budgets, lay.num_kv_heads, 0)
    heads = session.pager.segments[last.chunk_id].heads
    assert heads is not None and [row.tolist() for row in heads.kept] == keep


def test_a_snapshot_keeps_which_tokens_each_head_holds(
    model_dir: Path, head_calibration: Path, tmp_path: Path
) -> None:
    spec = f"entropy:{head_calibration}"
    original = make_manager(model_dir, spec, disk=tmp_path / "a").session("s")
    original.sync([Span(tokens(5, 4 * CHUNK + 3), ChunkKind.DOCUMENT)])
    original.memory.page_out([c for c in original.chunks.values() if c.original_start == CHUNK])
    snapshot.save(original, tmp_path / "a", "s-1.snap")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = make_manager(model_dir, "none", disk=tmp_path / "b").session("s")
    snapshot.restore(snapshot.load(tmp_path / "b" / "s-1.snap"), copy, tmp_path / "b")
    copy.swap_in()
    assert copy.stats()["kv_compression"] == spec  # the session's own setting came back with it
    assert copy.pager.order() == original.pager.order()
    for cid in original.pager.order():
        a = kv_of(original, original.pager.segments[cid])
        b = kv_of(copy, copy.pager.segments[cid])
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(original.pager.segments[cid].heads is not None for cid in original.pager.order())
    # the last two chunks (the last 3 tokens read the one before) still wait for their readers in both:
    # the reply's first steps choose them alike
    waiting = set(original.compressor.awaiting)
    assert len(waiting) == 2 and set(copy.compressor.awaiting) == waiting
    params = SamplingParams(max_tokens=WINDOW + 2, temperature=0.0, ignore_eos=True)
    assert replied(copy, params) == replied(original, params)
    assert not original.compressor.awaiting and not copy.compressor.awaiting
    chosen = [(original.pager.segments[cid].heads, copy.pager.segments[cid].heads) for cid in sorted(waiting)]
    assert chosen[0][0] is not None  # the 3-token chunk: one head-block a head, nothing to cut
    for a, b in chosen:
        assert (a is None and b is None) or (
            a is not None and b is not None and [r.tolist() for r in a.kept] == [r.tolist() for r in b.kept]
        )


def test_the_budget_counts_what_the_heads_keep(model_dir: Path, head_calibration: Path) -> None:
    """Half of each chunk kept per head: the same budget holds about twice the tokens resident (each
    chunk's charge is its rows' tokens over the rows), and never more than the model's positions allow."""
    ids = tokens(6, 40 * CHUNK)
    resident = {}
    for spec in ("none", f"entropy:{head_calibration}"):
        session = make_manager(model_dir, spec, budget=8 * CHUNK, mode="compact").session(spec)
        session.sync([Span(ids, ChunkKind.DOCUMENT)])
        stats = session.stats()
        assert stats["active_tokens"] <= 8 * CHUNK and stats["evictions"] > 0
        charge = sum(session.chunks[cid].cost for cid in session.pager.order())
        assert stats["active_tokens"] == charge
        resident[spec] = stats["resident_tokens"]
    assert resident["none"] <= 8 * CHUNK < 1.5 * resident["none"] <= resident[f"entropy:{head_calibration}"]

    bound = make_manager(model_dir, f"entropy:{head_calibration}", budget=8 * CHUNK, mode="compact").session(
        "b"
    )
    bound.pager.position_slack = CHUNK  # as for a model of 9 chunks' positions
    bound.sync([Span(ids, ChunkKind.DOCUMENT)])
    assert bound.pager.resident_tokens <= 9 * CHUNK  # where the charge alone would let in 12 chunks
    assert int(bound.pager.seq.positions.max()) < 9 * CHUNK


def test_a_prompt_is_compressed_once_by_its_own_last_queries(model_dir: Path, head_calibration: Path) -> None:
    """:func:`compress_prompt` (``kvos generate``'s prompt, read next only by the reply) sparsifies the
    prompt, then each head keeps its budget: the sinks and the best of the prompt's own last 32 queries'
    attention, as a plain sequence cut by :func:`observed_keep` holds it; ``kvos generate`` reports the K/V
    it holds."""
    ids, n = tokens(7, CHUNK), CHUNK
    spec = f"sparse:sweet+entropy:{head_calibration}"
    method = parse_compression(spec)
    assert method is not None and method.sparsifier is not None and method.budgets is not None
    engine = Engine(load_model(model_dir), block_size=BLOCK)
    lay, layers = engine.pool.layout, frozenset(range(engine.pool.layout.num_layers))
    seq = engine.new_sequence()
    compress_prompt(engine, seq, ids, method)
    (seg,) = seq.segments

    plain = engine.new_sequence()
    theirs = plain.open_segment()
    captured: dict[int, torch.Tensor] = {}
    engine.extend(plain, ids, None, "none", layers, captured, WINDOW)
    sparsifier = method.sparsifier
    engine.edit_kv(plain, theirs, 0, lambda pool, slots: sparsifier.apply(pool, slots, torch.arange(n)))
    budgets = method.budgets.for_chunk(n, lay.num_layers, lay.num_kv_heads, BLOCK)
    keep = observed_keep([captured[i] for i in range(lay.num_layers)], budgets, lay.num_kv_heads, 4)
    compress_heads(engine, plain, theirs, keep)
    assert seg.heads is not None and [row.tolist() for row in seg.heads.kept] == keep
    a, b = read_heads(engine, seg), read_heads(engine, theirs)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert bool((a[1] == 0).any())  # sparsified before the heads chose


def test_generate_holds_less_with_entropy_budgets(
    model_dir: Path, head_calibration: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvos.cli import main

    held = {}
    for spec in ("none", f"entropy:{head_calibration}@0.25"):
        argv = [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "waves and wind " * 20,
            "--max-tokens",
            "4",
        ]
        assert main([*argv, "--kv-compression", spec]) == 0
        err = capsys.readouterr().err
        held[spec] = int(err.split("K/V held ")[1].split()[0])
    assert held[f"entropy:{head_calibration}@0.25"] < 0.5 * held["none"]


def test_generate_keeps_a_chat_prompt_whole_as_sessions_keep_user_messages(
    model_dir: Path, head_calibration: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--chat`` makes the prompt a user message, which per-head budgets never cut in a session (a
    question cut to a quarter per head is lost: Qwen2.5-Coder answered another question): the same text
    and K/V as without compression, and a line saying why."""
    from kvos.cli import main

    runs = {}
    for spec in ("none", f"entropy-inverse:{head_calibration}@0.25"):
        argv = ["generate", "--model", str(model_dir), "--prompt", "waves and wind " * 20, "--chat"]
        assert main([*argv, "--max-tokens", "6", "--kv-compression", spec]) == 0
        runs[spec] = capsys.readouterr()
    plain, cut = runs["none"], runs[f"entropy-inverse:{head_calibration}@0.25"]
    assert cut.out == plain.out
    assert cut.err.split("K/V held ")[1] == plain.err.split("K/V held ")[1]
    assert "the prompt is a user message, which per-head budgets keep whole" in cut.err


def test_served_sessions_hold_more_tokens_per_byte(model_dir: Path, head_calibration: Path) -> None:
    """`kvos serve --kv-compression entropy:FILE` at its own defaults but a small budget: the replies'
    heads keep their budgets, so a saved token takes fewer bytes than in a session without compression,
    reported in usage, /v1/sessions and /metrics; asking for budgets the model has no calibration for is
    a 400 that changes nothing."""
    import httpx
    from server_harness import MODEL_NAME, running_server

    budget = 256
    with running_server(model_dir, "--kv-compression", f"entropy:{head_calibration}", budget=budget) as url:

        def turns(sid: str, n: int, kvos: dict[str, str] | None = None) -> httpx.Response:
            messages = [{"role": "system", "content": f"You are {sid}, a terse assistant. " * 4}]
            for turn in range(n):
                messages.append({"role": "user", "content": f"message {turn}: waves and wind"})
                body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 96, "temperature": 0}
                if kvos is not None:
                    body["kvos"] = kvos
                r = httpx.post(
                    f"{url}/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=60
                )
                if r.status_code != 200:
                    return r
                messages.append(
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                )
            return r

        usage = turns("c", 12).json()["usage"]["kvos"]
        dense = turns("d", 2, {"kv_compression": "none"}).json()["usage"]["kvos"]
        bad = turns("d", 1, {"kv_compression": "entropy"})  # the small model ships no calibration
        stats = {s["id"]: s for s in httpx.get(f"{url}/sessions").json()["data"]}
        metrics = httpx.get(url.replace("/v1", "/metrics")).text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kvos.kv_compression"
    assert "run `kvos calibrate" in bad.json()["error"]["message"]
    assert stats["d"]["kv_compression"] == "none"  # the bad request changed nothing
    c = stats["c"]
    assert c["max_active_tokens_seen"] <= budget and usage["active_tokens"] <= usage["resident_tokens"]
    assert c["head_chunks"] > 0 and c["resident_tokens"] == usage["resident_tokens"]
    # the replies (generated, and re-sent by the client) keep half their tokens per head: stored so
    assert c["saved_bytes_per_token"] < 0.85 * dense["saved_bytes_per_token"]
    assert 'kvos_session_resident_tokens{session="local/c"}' in metrics


def test_another_models_calibration_is_refused(model_dir: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"kv_head_entropies": {"L0_K0": 1.0}}')
    manager = make_manager(model_dir, "none")
    with pytest.raises(ConfigError, match="measured on another model"):
        manager.session("s").set_compression(f"entropy:{wrong}")


def test_a_chat_turn_captures_attention_only_for_chunks_that_wait(
    model_dir: Path, head_calibration: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply chosen by its own decode steps, then re-sealed when the next message follows it, is not
    chosen again; with nothing waiting, a user message's prefill captures no attention (it is never cut)."""
    session = make_manager(model_dir, f"entropy:{head_calibration}").session("s")
    session.add_message("user", "where are the lanterns? " * 3)
    session.generate(SamplingParams(max_tokens=CHUNK + 5, temperature=0.0, ignore_eos=True))
    assert session.compressor.chosen and not session.compressor.awaiting
    captured: list[frozenset[int]] = []
    append = session.pager.append

    def recording(chunk, logits="none", captured_=None, capture_layers=frozenset(), **kw):  # type: ignore[no-untyped-def]
        captured.append(capture_layers)
        return append(chunk, logits, captured_, capture_layers, **kw)

    monkeypatch.setattr(session.pager, "append", recording)
    session.add_message("user", "and the crates? " * 3)
    assert captured and all(not layers for layers in captured)
    assert not session.compressor.awaiting
