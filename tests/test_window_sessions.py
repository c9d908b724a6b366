"""Sessions over a model whose sliding-window layers let their K/V go (Gemma 3's interleaved layers).

Truncations within the margin go on from the pool; past it the history is read again. Swaps, restarts,
branches and paging at the chunks' own positions leave the session with the logits of a session on a pool
that keeps every layer's K/V (``window_margin=None``), within the dense models' session tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hf_models import build
from session_parts import small_chunks_manager, spans, tokens, with_builtin_tokenizer

from kvos.session import snapshot
from kvos.session.manager import MemoryManager
from kvos.session.session import Session

pytest.importorskip("transformers")

TOL = 1e-5
WINDOW, MARGIN = 16, 8  # keep = 24 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 (layers 0 and 2 slide over 16 positions, layer 1 is global) with the built-in
    tokenizer."""
    path = build(
        "gemma3",
        tmp_path_factory.mktemp("gemma3"),
        seed=5,
        vocab_size=2048,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
    )
    return with_builtin_tokenizer(path)


def manager(
    model_dir: Path,
    margin: int | None = MARGIN,
    budget: int = 4096,
    store_dir: Path | None = None,
    mode: str = "compact",
) -> MemoryManager:
    return small_chunks_manager(model_dir, budget, store_dir, mode, window_margin=margin)


def full_logits(model_dir: Path, *parts: list[int]) -> torch.Tensor:
    """The last logits of a fresh session given these parts, on a pool that keeps every layer's K/V."""
    s = manager(model_dir, margin=None).session("full")
    s.sync(spans(*parts))
    assert s.last_logits is not None
    return s.last_logits


def window_rows(s: Session) -> int:
    rows = s.engine.pool.rows
    assert rows is not None
    return rows.num_used


def test_a_long_history_holds_window_rows_for_its_tail_only(model_dir: Path) -> None:
    parts = [tokens(i, 30) for i in range(5)]
    s = manager(model_dir).session("s")
    s.sync(spans(*parts))
    torch.testing.assert_close(s.last_logits, full_logits(model_dir, *parts), rtol=0, atol=TOL)
    seq = s.pager.seq
    assert seq.num_tokens == 150 and len(seq.held) <= 24 + 8  # keep, and the slide runs by blocks
    assert window_rows(s) <= 5 < seq.num_blocks  # a block or two per chunk end at most
    stats = s.stats()
    dense = s.engine.pool.layout.bytes_per_token
    assert stats["resident_bytes_per_token"] < 0.5 * dense  # two of three layers hold 32 of 150 tokens


def test_a_rollback_within_the_margin_goes_on_from_the_pool(model_dir: Path) -> None:
    head, tail, other = tokens(10, 60), tokens(11, 20), tokens(12, 10)
    s = manager(model_dir).session("s")
    s.sync(spans(head, tail))
    result = s.sync(spans(head, tail[:15], other))  # 5 tokens back: inside the margin
    assert result.reused == 75 and s.memory.journal.count("window_gap") == 0
    torch.testing.assert_close(
        s.last_logits, full_logits(model_dir, head, tail[:15], other), rtol=0, atol=TOL
    )


def test_a_rollback_past_the_margin_reads_the_history_again(model_dir: Path) -> None:
    head, tail, other = tokens(13, 60), tokens(14, 40), tokens(15, 10)
    s = manager(model_dir).session("s")
    s.sync(spans(head, tail))
    result = s.sync(spans(head, tail[:5], other))  # 35 tokens back: the window layers let go of 40..64
    assert result.reused == 0 and s.memory.journal.count("window_gap") == 1
    torch.testing.assert_close(s.last_logits, full_logits(model_dir, head, tail[:5], other), rtol=0, atol=TOL)


def test_a_reply_and_a_new_turn_equal_the_full_cache(model_dir: Path) -> None:
    from kvos.engine.sampling import SamplingParams

    head, turn = tokens(16, 40), tokens(17, 12)
    s = manager(model_dir).session("s")
    s.sync(spans(head))
    reply = [e.token_id for e in s.reply(SamplingParams(max_tokens=40, ignore_eos=True))]
    ids = [t for t in reply if t is not None]
    s.sync(spans(head, ids, turn))
    torch.testing.assert_close(s.last_logits, full_logits(model_dir, head, ids, turn), rtol=0, atol=TOL)


def test_a_swap_keeps_what_the_window_layers_held_and_stores_the_rest_as_zeros(model_dir: Path) -> None:
    head, more = tokens(18, 90), tokens(19, 20)
    mm = manager(model_dir)
    s = mm.session("s")
    s.sync(spans(head))
    s.swap_out()
    assert s.engine.pool.allocator.num_used == 0 and window_rows(s) == 0
    store = s.pager.store
    assert store is not None
    stats = store.stats()
    # the global layer's K/V dense, the window layers' of the tokens they had let go as a bitmask of zeros
    assert stats["stored_bytes"] < 0.6 * stats["raw_bytes"]
    s.swap_in()
    assert [seg.held_from for seg in s.pager.seq.segments][:2] == [24, 24]
    s.sync(spans(head, more))
    torch.testing.assert_close(s.last_logits, full_logits(model_dir, head, more), rtol=0, atol=TOL)


def test_a_restart_restores_what_the_window_layers_held(model_dir: Path, tmp_path: Path) -> None:
    head, more = tokens(20, 70), tokens(21, 20)
    original = manager(model_dir, store_dir=tmp_path / "a").session("s")
    original.sync(spans(head))
    held = [seg.held_from for seg in original.pager.seq.segments]
    snapshot.save(original, tmp_path / "a", "s.snap")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = manager(model_dir, store_dir=tmp_path / "b").session("s")
    snapshot.restore(snapshot.load(tmp_path / "b" / "s.snap"), copy, tmp_path / "b")
    copy.swap_in()
    assert [seg.held_from for seg in copy.pager.seq.segments] == held != [0, 0, 0]
    copy.sync(spans(head, more))
    torch.testing.assert_close(copy.last_logits, full_logits(model_dir, head, more), rtol=0, atol=TOL)


def test_a_branch_and_its_parent_each_equal_the_full_cache(model_dir: Path) -> None:
    head, tail, other = tokens(22, 70), tokens(23, 30), tokens(24, 12)
    mm = manager(model_dir)
    parent = mm.session("main")
    parent.sync(spans(head))
    child = mm.fork("main", "branch", 70)
    parent.sync(spans(head, tail))
    child.sync(spans(head, other))
    torch.testing.assert_close(child.last_logits, full_logits(model_dir, head, other), rtol=0, atol=TOL)
    torch.testing.assert_close(parent.last_logits, full_logits(model_dir, head, tail), rtol=0, atol=TOL)
    mm.close("branch")
    mm.close("main")
    assert mm.engine.pool.allocator.num_used == 0 and mm.engine.pool.rows is not None
    assert mm.engine.pool.rows.num_used == 0


@pytest.mark.parametrize("mode", ["sparse", "compact"])
def test_paging_under_a_budget(model_dir: Path, mode: str) -> None:
    """At their own positions (sparse) a chunk comes back behind every later window, so the session equals
    one whose pool keeps every layer; compacted, a window layer reads only what it still holds (the full
    pool would show it older tokens moved up), and the rows stay in step with the chunks."""
    parts = [tokens(30 + i, 22) for i in range(7)]
    sliding = manager(model_dir, budget=64, mode=mode).session("s")
    full = manager(model_dir, margin=None, budget=64, mode=mode).session("s")
    for i in range(1, 8):
        for s in (sliding, full):
            s.sync(spans(*parts[:i]))
        if mode == "sparse":
            torch.testing.assert_close(sliding.last_logits, full.last_logits, rtol=0, atol=TOL)
    assert sliding.memory.journal.count("evict") > 0 and sliding.pager.active_tokens <= 64
    seq = sliding.pager.seq
    for seg in seq.segments:  # every block the table still claims for its window has its row
        table = seg.page_table
        first = len(table.blocks) if seg.held_from >= seg.num_tokens else seg.held_from // table.block_size
        assert all(sliding.engine.pool.has_row(b) for b in table.blocks[first:])


@pytest.mark.parametrize("swapped", [False, True])
def test_a_branch_past_the_margin_reads_its_history_again(model_dir: Path, swapped: bool) -> None:
    """A branch cut where the parent's window layers have let go (its chunks resident, or saved by a swap)
    starts empty and reads its history again, as the full cache would have it."""
    head, tail, other = tokens(25, 48), tokens(26, 60), tokens(27, 10)
    mm = manager(model_dir)
    parent = mm.session("main")
    parent.sync(spans(head, tail))
    if swapped:
        parent.swap_out()
    child = mm.fork("main", "branch", 48)
    assert child.history.tokens == 0 and child.memory.journal.count("window_gap") == 1
    child.sync(spans(head, other))
    torch.testing.assert_close(child.last_logits, full_logits(model_dir, head, other), rtol=0, atol=TOL)
    if not swapped:  # (saved, the chunk holding token 100 cannot be cut: the cut would go back to 96)
        near = mm.fork("main", "near", 100)  # 8 tokens before the parent's end: inside the margin
        assert near.history.tokens == 100 and near.memory.journal.count("window_gap") == 0


def test_a_restart_that_keeps_every_layer_recomputes_what_the_window_let_go(
    model_dir: Path, tmp_path: Path
) -> None:
    """A state saved by a pool whose window layers slid, restored by one started with ``--window-margin
    full``: the chunks saved without their window layers' K/V are read again (zeros in their place would be
    keys every query saw), the others spliced back; the session equals the full cache."""
    head, more = tokens(28, 70), tokens(29, 20)
    original = manager(model_dir, store_dir=tmp_path / "a").session("s")
    original.sync(spans(head))
    slid = [cid for cid, seg in original.pager.segments.items() if seg.held_from]
    assert slid
    snapshot.save(original, tmp_path / "a", "s.snap")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = manager(model_dir, margin=None, store_dir=tmp_path / "b").session("s")
    snapshot.restore(snapshot.load(tmp_path / "b" / "s.snap"), copy, tmp_path / "b")
    copy.swap_in()
    recomputed = [e["chunk"] for e in copy.memory.journal.events if e["event"] == "recompute"]
    assert sorted(recomputed) == sorted(slid)
    copy.sync(spans(head, more))
    torch.testing.assert_close(copy.last_logits, full_logits(model_dir, head, more), rtol=0, atol=TOL)
