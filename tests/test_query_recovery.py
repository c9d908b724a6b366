"""Recovery from the model's own queries: the "attention" signal (key digests of saved chunks against the new
message's queries, restored in front of the message) and the "hybrid" signal (a digest and lexical shortlist,
then the answer signal on the shortlist only), on the built-in model; per-message costs are recorded."""

from __future__ import annotations

import pytest
import torch
from test_relevance import buried_fact_session

from kvos.engine.sampling import SamplingParams
from kvos.policy.chunks import ChunkState
from kvos.session.relevance import AnswerContrast


def test_saved_chunks_keep_a_digest_and_restores_land_in_front_of_the_message() -> None:
    manager, s, _ = buried_fact_session("attention", check=False)
    # the signal may have brought the fact's exchange back for a filler question: out before the question
    s.memory.page_out([c for c in s.chunks.values() if c.message_index in (1, 2) and c.resident])
    config = manager.engine.model.config
    saved = [c for c in s.chunks.values() if c.state is ChunkState.SAVED]
    assert saved and all(c.digest is not None for c in saved)
    for c in saved:
        assert c.digest.lo.shape == (config.num_layers, config.num_kv_heads, config.head_dim)
        assert (c.digest.lo <= c.digest.hi).all()
    digest_bytes = sum(c.digest.nbytes for c in saved)
    saved_bytes = s.pager.store.stats()["raw_bytes"]
    assert digest_bytes < 0.05 * saved_bytes  # 40-token chunks of a 4-layer float32 model: ~1.3%
    users_before = len(s.memory.costs.turns)
    appended: list[tuple[int, int]] = []  # (chunk id, first position) of every prefill
    real_append = s.pager.append

    def append(chunk, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_append(chunk, *args, **kwargs)
        appended.append((chunk.chunk_id, int(chunk.current_start)))
        return out

    s.pager.append = append  # type: ignore[method-assign]
    question = s.add_message("user", "What is my job?")
    restored = [
        e["chunk"] for e in s.memory.journal.events if e["turn"] == s.history.turn and e["event"] == "restore"
    ]
    assert restored, "the signal brought nothing back"
    order = s.pager.order()
    mine = [c.chunk_id for c in question]
    assert order[-len(mine) :] == mine  # the message stays last ...
    assert set(order[-len(mine) - len(restored) : -len(mine)]) == set(restored)  # ... the restored in front
    positions = s.pager.seq.positions.tolist()
    assert positions == list(range(len(positions)))  # compact: the message moved up, no gap, no overlap
    assert all(c.chunk_id in s.history.protected for c in question)
    # the message was prefilled, scored, then prefilled again behind what came back, where it now stands
    again = [(c.chunk_id, int(c.current_start)) for c in question]
    assert appended == [(c.chunk_id, appended[i][1]) for i, c in enumerate(question)] + again
    assert again[0][1] > appended[0][1]  # moved up by the restored chunks' tokens
    assert len(s.memory.costs.turns) == users_before + 1
    turn = s.memory.costs.turns[-1]
    assert turn["prefill_s"] > 0 and turn["recovery_s"] > 0 and turn["restore_s"] > 0
    assert s.generate(SamplingParams(max_tokens=8))[1]  # the message's new logits start a reply
    manager.close(s.session_id)


def test_hybrid_asks_the_model_only_about_its_shortlist(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, s, fact = buried_fact_session("hybrid", check=False, recovery_shortlist=1)
    seen: list[dict] = []
    original = AnswerContrast.scores

    def spy(self: AnswerContrast, prefix: list[int], query: list[int], candidates: dict, answer=None) -> dict:
        seen.append(dict(candidates))
        assert answer is not None  # the null answer came from the tapped scratch pass, not a second one
        return original(self, prefix, query, candidates, answer)

    monkeypatch.setattr(AnswerContrast, "scores", spy)
    s.add_message("user", "What is my job?")
    assert seen and all(1 <= len(c) <= 2 for c in seen)  # one by attention, one by words (maybe the same)
    assert all(c.resident for c in fact)  # the shortlist held the fact; the model picked it
    assert "translator" in s.generate(SamplingParams(max_tokens=16))[0]
    manager.close(s.session_id)


def test_restores_go_in_front_of_the_first_chunk_of_the_message_still_resident() -> None:
    """Paging may take a long message's first chunks (while its last ones are prefilled, or to make room
    for a restore): what comes back lands in front of its first chunk still resident (a KeyError before)."""
    manager, s, _ = buried_fact_session("attention", check=False, recovery_min_similarity=-1.0)
    chunks = s.add_message("user", "What is my job? Tell me. " * 5)
    assert len(chunks) >= 2
    s.memory.page_out([chunks[0]])
    config = manager.engine.model.config
    queries = torch.randn(config.num_layers, 8, config.num_heads, config.head_dim)
    restores = s.memory.journal.count("restore")
    s.signal.after_message(chunks, queries)
    assert s.memory.journal.count("restore") > restores
    order = s.pager.order()
    tail = [c.chunk_id for c in chunks[1:]]
    assert order[-len(tail) :] == tail
    manager.close(s.session_id)


def test_a_message_longer_than_the_budget_does_not_lose_its_anchor() -> None:
    """The message's first chunks are paged out while its last ones are prefilled (160-token budget, a
    ~300-token message): restores go in front of its first chunk still resident (a KeyError before)."""
    manager, s, _ = buried_fact_session("attention", check=False)
    chunks = s.add_message("user", "Tell me again, what is my job? " * 40)
    assert not chunks[0].resident and chunks[-1].resident
    assert s.pager.active_tokens <= 160
    assert s.pager.order()[-1] == chunks[-1].chunk_id
    assert s.generate(SamplingParams(max_tokens=4))[1]
    manager.close(s.session_id)
