"""A hybrid model's sessions: the recurrent state under truncation, branches, swaps, restarts and paging.

The attention layers' chunks are paged as for any model; the linear-attention layers' state, which cannot
be cut into chunks, is checkpointed at chunk boundaries. Each test compares with a fresh session that was
given the same history directly (never cut, forked, swapped or restarted): the logits must agree within
the dense models' session tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hf_models import build
from session_parts import small_chunks_manager, spans, tokens, with_builtin_tokenizer

from kvos.engine.engine import Engine
from kvos.memory.growth import GrowthPolicy
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkState
from kvos.session import snapshot
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.session import Session

pytest.importorskip("transformers")

TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3.5", "lfm2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 (three delta-net layers, one attention layer, twice) or LFM2 (short convolutions and
    attention) with the built-in tokenizer."""
    layers = {"num_hidden_layers": 8} if request.param == "qwen3.5" else {}
    path = build(request.param, tmp_path_factory.mktemp(request.param), seed=5, vocab_size=2048, **layers)
    return with_builtin_tokenizer(path)


def manager(
    model_dir: Path, budget: int = 4096, store_dir: Path | None = None, mode: str = "compact"
) -> MemoryManager:
    return small_chunks_manager(model_dir, budget, store_dir, mode)


def fresh_logits(model_dir: Path, *parts: list[int]) -> torch.Tensor:
    s = manager(model_dir).session("fresh")
    s.sync(spans(*parts))
    assert s.last_logits is not None
    return s.last_logits


def test_a_diverging_prompt_goes_back_to_the_checkpoint_before_it(model_dir: Path) -> None:
    head, middle, tail, other = tokens(1, 50), tokens(2, 40), tokens(3, 20), tokens(4, 15)
    s = manager(model_dir).session("s")
    s.sync(spans(head, middle, tail))
    # diverge 10 tokens into `middle`'s second chunk (chunks of 24: 50 = 24 + 24 + 2, then 24 + 16)
    result = s.sync(spans(head, middle[:34], other))
    assert result.reused == 74  # the last checkpoint at or before 84 tokens: the end of middle's first chunk
    assert s.pager.seq.recurrent is not None and s.pager.seq.recurrent.tokens == s.history.tokens == 99
    torch.testing.assert_close(
        s.last_logits, fresh_logits(model_dir, head, middle[:34], other), rtol=0, atol=TOL
    )


def test_a_cut_older_than_every_checkpoint_reads_the_history_again(model_dir: Path) -> None:
    s = manager(model_dir).session("s")
    parts = [tokens(10 + i, 24) for i in range(12)]  # 12 chunk boundaries, more than the session keeps
    for i in range(1, 13):
        s.sync(spans(*parts[:i]))
    assert s.checkpoints.entries[0][0] > 24
    other = tokens(30, 10)
    result = s.sync(spans(parts[0][:10], other))
    assert result.reused == 0
    torch.testing.assert_close(s.last_logits, fresh_logits(model_dir, parts[0][:10], other), rtol=0, atol=TOL)


def test_a_branch_starts_from_the_parents_state_at_its_length(model_dir: Path) -> None:
    head, tail, other = tokens(5, 72), tokens(6, 20), tokens(7, 12)
    mm = manager(model_dir)
    parent = mm.session("main")
    parent.sync(spans(head))
    parent.sync(spans(head, tail))
    child = mm.fork("main", "branch", 60)  # inside head's third chunk: back to the checkpoint at 48
    assert child.history.tokens == 48
    assert child.pager.seq.recurrent is not None and child.pager.seq.recurrent.tokens == 48
    child.sync(spans(head, other))
    torch.testing.assert_close(child.last_logits, fresh_logits(model_dir, head, other), rtol=0, atol=TOL)
    whole = mm.fork("main", "whole", parent.history.tokens)  # the whole history: the parent's live state
    whole.sync(spans(head, tail, other))
    torch.testing.assert_close(
        whole.last_logits, fresh_logits(model_dir, head, tail, other), rtol=0, atol=TOL
    )


def test_a_swap_keeps_the_state(model_dir: Path) -> None:
    head, more = tokens(8, 60), tokens(9, 20)
    mm = manager(model_dir)
    s = mm.session("s")
    s.sync(spans(head))
    s.swap_out()
    assert s.pager.active_tokens == 0
    s.swap_in()
    s.sync(spans(head, more))
    torch.testing.assert_close(s.last_logits, fresh_logits(model_dir, head, more), rtol=0, atol=TOL)


def restored(model_dir: Path, source: Path, target: Path) -> Session:
    """The session saved in ``source``, restored from a copy of it (a restart reads what is on disk)."""
    shutil.copytree(source, target)
    s = manager(model_dir, store_dir=target).session("s")
    snapshot.restore(snapshot.load(target / "s.snap"), s, target)
    s.swap_in()
    return s


def test_a_restart_restores_the_state_and_its_checkpoints(model_dir: Path, tmp_path: Path) -> None:
    head, middle, more = tokens(11, 60), tokens(12, 30), tokens(13, 20)
    original = manager(model_dir, store_dir=tmp_path / "a").session("s")
    original.sync(spans(head, middle))
    snapshot.save(original, tmp_path / "a", "s.snap")
    copy = restored(model_dir, tmp_path / "a", tmp_path / "b")
    assert copy.pager.seq.recurrent is not None and copy.pager.seq.recurrent.tokens == 90
    assert [at for at, _ in copy.checkpoints.entries] == [at for at, _ in original.checkpoints.entries]
    copy.sync(spans(head, middle, more))
    torch.testing.assert_close(
        copy.last_logits, fresh_logits(model_dir, head, middle, more), rtol=0, atol=TOL
    )
    cut = restored(model_dir, tmp_path / "a", tmp_path / "c")  # and a cut after the restart
    cut.sync(spans(head[:50], more))
    torch.testing.assert_close(cut.last_logits, fresh_logits(model_dir, head[:50], more), rtol=0, atol=TOL)


def test_a_snapshot_without_the_state_is_refused_for_a_hybrid_model(model_dir: Path, tmp_path: Path) -> None:
    original = manager(model_dir, store_dir=tmp_path).session("s")
    original.sync(spans(tokens(14, 30)))
    snap = snapshot.save(original, tmp_path, "s.snap")
    snap.header["session"]["recurrent"] = None
    with pytest.raises(Exception, match="recurrent state"):
        snapshot.restore(snap, manager(model_dir, store_dir=tmp_path).session("s"), tmp_path)


@pytest.mark.parametrize("mode", ["compact", "sparse"])
def test_paging_under_a_budget_keeps_the_state_in_step_with_the_history(model_dir: Path, mode: str) -> None:
    """Evicted chunks leave the recurrent state as it is (it holds them already), and a recomputed one is
    read without being taken in again; in either position mode (compacted, or at their own positions)."""
    s = manager(model_dir, budget=64, mode=mode).session("s")
    parts = [tokens(20 + i, 30) for i in range(6)]
    for i in range(1, 7):
        s.sync(spans(*parts[:i]))
        assert s.pager.seq.recurrent is not None and s.pager.seq.recurrent.tokens == s.history.tokens
    assert s.memory.journal.count("evict") > 0 and s.pager.active_tokens <= 64
    per_state = sum(d.nbytes for d in s.pager.seq.recurrent.layers.values())
    kept = len({id(st.layers[0]) for _, st in s.checkpoints.entries} | {id(s.pager.seq.recurrent.layers[0])})
    assert s.stats()["recurrent_bytes"] == kept * per_state > per_state  # the live state and its checkpoints
    lost = next(c for c in s.chunks.values() if c.state is not ChunkState.RESIDENT)
    before = dict(s.pager.seq.recurrent.layers)
    s.pager.discard(lost)
    s.pager.recompute(lost)
    assert s.pager.seq.recurrent.layers == before and s.pager.seq.recurrent.tokens == s.history.tokens


def test_a_reply_and_a_new_turn_continue_as_a_fresh_session(model_dir: Path) -> None:
    """A reply's tokens go into the state as they are decoded; the next turn equals a fresh session given
    the same history."""
    head, turn = tokens(40, 40), tokens(41, 12)
    mm = manager(model_dir)
    s: Session = mm.session("s")
    s.sync(spans(head))
    from kvos.engine.sampling import SamplingParams

    reply = [e.token_id for e in s.reply(SamplingParams(max_tokens=30, ignore_eos=True))]
    ids = [t for t in reply if t is not None]
    assert len(ids) == 30
    s.sync(spans(head, ids, turn))
    torch.testing.assert_close(s.last_logits, fresh_logits(model_dir, head, ids, turn), rtol=0, atol=TOL)


def test_with_no_checkpoints_a_cut_reads_the_history_again(model_dir: Path) -> None:
    engine = Engine(load_model(model_dir, dtype="float32"), block_size=8)
    config = SessionConfig(
        budget=Budget(max_active_tokens=4096, policy="hard"),
        chunk_tokens=24,
        embedder="tokens",
        recovery_signal="lexical",
        recurrent_checkpoints=0,
    )
    s = MemoryManager(engine, load_tokenizer(model_dir), config).session("s")
    head, other = tokens(50, 60), tokens(51, 10)
    s.sync(spans(head))
    assert not s.checkpoints.entries and s.stats()["recurrent_bytes"] > 0  # the live state only
    result = s.sync(spans(head[:55], other))
    assert result.reused == 0
    torch.testing.assert_close(s.last_logits, fresh_logits(model_dir, head[:55], other), rtol=0, atol=TOL)


def test_the_recurrent_states_count_against_the_pools_cap(model_dir: Path) -> None:
    """A session's live state and checkpoints are in the pool's accounting: a cap that holds the history's
    K/V but not those states too makes the session page chunks out to stay within it; closing the session
    takes them out again."""
    history = [tokens(40 + i, 24) for i in range(5)]
    probe = manager(model_dir).session("probe")
    probe.sync(spans(*history))
    states = probe.stats()["recurrent_bytes"]
    pool = probe.engine.pool
    assert pool.side_bytes == states > 0
    per_block = pool.layout.bytes_per_block
    cap = states + 12 * per_block  # 12 blocks of 8 tokens: the 120 tokens' 15 blocks do not fit beside them
    engine = Engine(
        load_model(model_dir, dtype="float32"),
        block_size=8,
        growth=GrowthPolicy(initial_tokens=8, max_bytes=cap),
    )
    capped = MemoryManager(engine, probe.tokenizer, probe.config)
    s = capped.session("s")
    s.sync(spans(*history))
    assert s.memory.journal.count("pool_full") > 0  # it paged out to make room beside its states
    assert engine.pool.side_bytes == s.stats()["recurrent_bytes"]
    assert engine.pool.live_bytes + engine.pool.side_bytes <= cap
    s.swap_out()  # swapped out, its states wait beside its saved chunks, outside the pool
    assert engine.pool.side_bytes == 0 and s.stats()["recurrent_bytes"] > 0
    s.swap_in()
    assert engine.pool.side_bytes == s.stats()["recurrent_bytes"]
    capped.close("s")
    assert engine.pool.side_bytes == 0 and not engine.pool.side
