"""The "answer" recovery signal: scores are exact log-likelihood drops (checked against transformers), the
null answer stops where it should, and in a session it brings back a fact that shares no content word with
the question (built-in model), caps its candidates and falls back to lexical when the pool is full."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import hf_model

from kvos.builtin import builtin_model_path
from kvos.engine.engine import Engine
from kvos.engine.sampling import SamplingParams
from kvos.memory.growth import GrowthPolicy
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkState
from kvos.policy.lexical import LexicalIndex
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.relevance import AnswerContrast
from kvos.session.session import Session


def hf_log_likelihood(model: object, context: list[int], answer: list[int]) -> float:
    ids = torch.tensor([context + answer[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1 :].double()  # type: ignore[operator]
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None]).sum())


def test_scores_are_the_drop_in_the_null_answers_log_likelihood(model_dir: Path) -> None:
    engine = Engine(load_model(model_dir), block_size=8)
    contrast = AnswerContrast(engine, generation_prompt=[7, 8], eos_ids=[], max_new=5)
    prefix, query = [1, 2, 3], [40, 41, 42, 43]
    candidates = {"a": [50, 51, 52], "b": list(range(60, 80)), "c": [99]}
    scores = contrast.scores(prefix, query, candidates)
    answer = contrast.null_answer(prefix + query + [7, 8])
    assert len(answer) == 5  # no end-of-turn token given: stops at max_new
    reference = hf_model(model_dir)
    greedy = prefix + query + [7, 8]
    for _ in range(5):  # transformers' greedy continuation, one argmax at a time
        with torch.no_grad():
            greedy.append(int(reference(torch.tensor([greedy])).logits[0, -1].argmax()))
    assert answer == greedy[-5:]
    base = hf_log_likelihood(reference, prefix + query + [7, 8], answer)
    for key, tokens in candidates.items():
        expected = base - hf_log_likelihood(reference, prefix + tokens + query + [7, 8], answer)
        assert scores[key] == pytest.approx(expected, abs=1e-4)
    assert len({round(v, 6) for v in scores.values()}) == 3
    assert engine.pool.allocator.num_used == 0  # scratch sequences released


def test_candidates_share_forward_passes_and_score_as_one_pass_each(model_dir: Path) -> None:
    """The reference pass and the candidates' passes run packed into as few forward passes as fit in
    ``pack_tokens`` (whole 8-token blocks): everything in one pass, or one pass each when the limit is a
    block; the scores agree (float32, 1e-4 nats), and the scratch blocks never pass ``scratch_tokens``."""
    prefix, query = [1, 2, 3], [40, 41, 42, 43]
    candidates = {"a": [50, 51, 52], "b": list(range(60, 80)), "c": [99], "d": list(range(5, 17))}
    results = []
    for pack_tokens, passes in ((None, 1), (8, 5), (48, 3)):
        engine = Engine(load_model(model_dir), block_size=8)
        contrast = AnswerContrast(engine, [7, 8], eos_ids=[], max_new=5, pack_tokens=pack_tokens)
        answer = contrast.null_answer(prefix + query + [7, 8])
        calls, peak = [], [0]
        real = engine.model.forward_batch

        def counting(items, kv, real=real, calls=calls, peak=peak, pool=engine.pool):  # type: ignore[no-untyped-def]
            calls.append(len(items))
            peak[0] = max(peak[0], pool.allocator.num_used)
            return real(items, kv)

        engine.model.forward_batch = counting  # type: ignore[method-assign]
        results.append(contrast.scores(prefix, query, candidates, answer=answer))
        assert len(calls) == passes and sum(calls) == 1 + len(candidates)
        scratch = contrast.scratch_tokens(prefix, query, candidates.values())
        assert peak[0] * 8 <= scratch
        assert engine.pool.allocator.num_used == 0
    for scores in results[1:]:
        for key in candidates:
            assert scores[key] == pytest.approx(results[0][key], abs=1e-4)
    with pytest.raises(ValueError, match="pack_tokens"):
        AnswerContrast(engine, [], [], pack_tokens=0)


def test_a_capped_pool_keeps_the_packs_within_the_requests_reservation() -> None:
    """Uncapped, the passes pack up to the engine's slice; under a pool cap (``kvos serve --kv-memory``)
    at most a budget's tokens, the scratch share of what a request reserves (SessionConfig.peak_blocks)."""
    path = builtin_model_path()
    config = SessionConfig(
        budget=Budget(max_active_tokens=160, policy="hard"), chunk_tokens=40, recovery_signal="answer"
    )
    for growth, pack in ((None, None), (GrowthPolicy(max_bytes=64 << 20), 160)):
        manager = MemoryManager(Engine(load_model(path), growth=growth), load_tokenizer(path))
        session = manager.session(config=config)
        assert session.signal.answer is not None and session.signal.answer.pack_tokens == pack


def test_null_answer_stops_after_an_end_of_turn_token(model_dir: Path) -> None:
    engine = Engine(load_model(model_dir), block_size=8)
    free = AnswerContrast(engine, [], eos_ids=[], max_new=4).null_answer([5, 6, 7])
    stopping = AnswerContrast(engine, [], eos_ids=[free[1]], max_new=4).null_answer([5, 6, 7])
    assert stopping == free[: free.index(free[1]) + 1]  # greedy, cut after the first end-of-turn token
    with pytest.raises(ValueError, match="max_new"):
        AnswerContrast(engine, [], [], max_new=0)


def buried_fact_session(
    signal: str, fillers: int = 8, check: bool = True, **cfg: object
) -> tuple[MemoryManager, Session, list]:
    """The built-in model; a fact the question shares no content word with, then ``fillers`` exchanges
    (8 page it out under the 160-token budget; after 5 it is still resident, the least recent exchange;
    ``check``: assert so, for signals that bring back nothing on the filler questions)."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    config = SessionConfig(
        budget=Budget(max_active_tokens=160, policy="hard"), chunk_tokens=40, recovery_signal=signal, **cfg
    )  # type: ignore[arg-type]
    s = manager.session(config=config)
    s.add_message("system", "You are a helpful assistant.")
    fact = s.add_message("user", "For a living I work as a translator.")
    s.add_message("assistant", "Got it: you work as a translator.")
    for a, b in ((3, 4), (12, 9), (7, 7), (20, 5), (6, 16), (8, 2), (11, 13), (4, 19))[:fillers]:
        s.add_message("user", f"What is {a} plus {b}?")
        s.add_message("assistant", f"{a} plus {b} is {a + b}.")
    expected = ChunkState.SAVED if fillers == 8 else ChunkState.RESIDENT
    assert not check or all(chunk.state is expected for chunk in fact)
    return manager, s, fact


@pytest.mark.parametrize("signal", ["answer", "lexical"])
def test_answer_signal_recovers_a_fact_without_shared_words(signal: str) -> None:
    manager, s, fact = buried_fact_session(signal)
    s.add_message("user", "What is my job?")
    reply = s.generate(SamplingParams(max_tokens=16))[0]
    if signal == "answer":  # the fact and its acknowledgement (one exchange) are back
        ack = [c for c in s.chunks.values() if c.message_index == fact[0].message_index + 1]
        assert ack and all(chunk.resident for chunk in fact + ack) and "translator" in reply
    else:  # the lexical signal finds no rare word in common: the fact stays out and the model cannot answer
        assert not any(chunk.resident for chunk in fact) and "translator" not in reply
    manager.close(s.session_id)


@pytest.mark.parametrize("signal", ["answer", "lexical"])
def test_answer_signal_keeps_a_resident_fact_the_question_needs(signal: str) -> None:
    """Making room for the question pages out the least recent exchange, the fact's; the answer signal
    (asked because a filler exchange is saved) protects the exchange the answer needs for the turn, the
    lexical one cannot see it."""
    manager, s, fact = buried_fact_session(signal, fillers=5)
    first_filler = [c for c in s.chunks.values() if c.message_index in (3, 4)]
    s.memory.page_out(first_filler)
    question = "What is my job, please? Answer me in one short sentence, thank you very much, and be quick."
    assert s.pager.active_tokens + len(s.tokenizer.encode(question)) > 160  # it needs an eviction
    s.add_message("user", question)
    state = ChunkState.RESIDENT if signal == "answer" else ChunkState.SAVED
    assert all(chunk.state is state for chunk in fact)
    manager.close(s.session_id)


def test_candidates_are_capped_lexically_and_pool_pressure_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager, s, _ = buried_fact_session("answer", recovery_candidates=1)
    seen: list[tuple[dict, int]] = []
    original = AnswerContrast.scores

    def spy(self: AnswerContrast, prefix: list[int], query: list[int], candidates: dict) -> dict:
        index = LexicalIndex(c.token_ids for c in s.chunks.values())
        exchanges: dict[int, list[int]] = {}  # user message index -> its text and its reply's
        for c in sorted(s.chunks.values(), key=lambda c: c.original_start):
            if c.message_index > 0:  # message 0 is the system prompt (the sink)
                exchanges.setdefault(c.message_index - (c.message_index + 1) % 2, []).extend(c.token_ids)
        assert len(exchanges) > 1 and s.messages[max(exchanges)]["role"] == "user"
        closest = max(exchanges, key=lambda m: (index.score(query, exchanges[m]), m))
        assert candidates[closest] == exchanges[closest]  # scored on the whole exchange
        seen.append((dict(candidates), closest))
        return original(self, prefix, query, candidates)

    monkeypatch.setattr(AnswerContrast, "scores", spy)
    s.add_message("user", "What is 7 plus 7?")
    [(candidates, closest)] = seen
    assert list(candidates) == [closest]  # one candidate, the lexically closest exchange
    assert "7 plus 7" in s.messages[closest]["content"]

    def never(*args: object) -> dict:
        raise AssertionError("the scratch passes ran though the pool could not hold them")

    # a pool that can hold a restore but not the answer signal's scratch passes: asked first, they do not run
    monkeypatch.setattr(AnswerContrast, "scores", never)
    monkeypatch.setattr(AnswerContrast, "scratch_tokens", lambda *args: 1 << 20)
    pool = manager.engine.pool
    monkeypatch.setattr(pool, "can_allocate", lambda n: n < 1 << 12)
    s.add_message("user", "I work as what, again? translator?")
    events = [e for e in s.memory.journal.events if e["turn"] == s.history.turn]
    assert any(e["event"] == "answer_signal_skipped" for e in events)
    assert any(e["event"] == "restore" for e in events)  # lexical took over ("work", "translator")
    manager.close(s.session_id)


def test_an_exchange_too_large_comes_back_as_its_whole_message() -> None:
    """Under a 64-token budget the code's exchange (20 + 19 tokens in four 16-token chunks) cannot come
    back whole; its user message must (both chunks), not only its first chunk, which ends before the
    code's last character."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    config = SessionConfig(
        budget=Budget(max_active_tokens=64, policy="hard"), chunk_tokens=16, recovery_signal="answer"
    )
    s = manager.session(config=config)
    s.add_message("system", "You are a helpful assistant.")
    fact = s.add_message("user", "Note this down: my access code is V1-BP4.")
    ack = s.add_message("assistant", "Got it: your access code is V1-BP4.")
    for a, b in ((3, 4), (12, 9)):
        s.add_message("user", f"What is {a} plus {b}?")
        s.add_message("assistant", f"{a} plus {b} is {a + b}.")
    assert len(fact) == len(ack) == 2 and all(c.state is ChunkState.SAVED for c in fact + ack)
    s.add_message("user", "What was my code?")
    assert [c.state for c in fact + ack] == [ChunkState.RESIDENT] * 2 + [ChunkState.SAVED] * 2
    assert "V1-BP4" in s.generate(SamplingParams(max_tokens=16))[0]
    manager.close(s.session_id)


def test_answer_signal_reads_bounded_spans_of_long_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's long system prompt and a long user message: every candidate the answer signal scores, and
    the query, are at most min(budget, 4 chunks) tokens (one pass over a 30,000-token message took 190 s)."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    config = SessionConfig(budget=Budget(max_active_tokens=256), chunk_tokens=32, recovery_signal="answer")
    s = manager.session(config=config)
    seen: list[tuple[list[int], dict]] = []
    original = AnswerContrast.scores

    def spy(self: AnswerContrast, prefix: list[int], query: list[int], candidates: dict) -> dict:
        seen.append((list(query), dict(candidates)))
        return original(self, prefix, query, candidates)

    monkeypatch.setattr(AnswerContrast, "scores", spy)
    s.add_message("system", " ".join(f"Rule {i}: read each file before you edit it." for i in range(60)))
    s.add_message("user", "My favourite number is 4242. " + "Please keep it in mind. " * 30)
    s.add_message("assistant", "Got it.")
    s.add_message("user", "What is my favourite number?")
    assert seen
    for query, candidates in seen:
        assert len(query) <= 128 and candidates
        assert all(len(tokens) <= 128 for tokens in candidates.values())
    manager.close(s.session_id)
