"""The knowledge corpus for pretrained chat models (kvos.builtin.knowledge): deterministic per seed, other
seeds other facts and questions, sessions of the demo's 14-turn shape in the 1,150-1,650 token range of a
real BPE tokenizer (SmolLM2's from ../shared, Qwen2.5-Coder's when pulled; the built-in tokenizer's finer
range otherwise)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from kvos.builtin import builtin_model_path
from kvos.builtin.corpus import DEMO_SEED
from kvos.builtin.evaluate import answered
from kvos.builtin.knowledge import (
    BENCH_KINDS,
    FACT_KINDS,
    KNOWLEDGE_SEED,
    QUESTIONS_PER_SESSION,
    knowledge_demo_session,
    knowledge_session,
    knowledge_sessions,
)
from kvos.builtin.knowledge_pool import QUESTIONS
from kvos.builtin.playback import session_tokens
from kvos.errors import KvosError
from kvos.model.catalogue import resolve_model
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import Tokenizer, load_tokenizer

SMOLLM2 = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN = "qwen2.5-coder-0.5b-instruct"


def _sizes(tokenizer: Tokenizer, n: int = 60) -> list[int]:
    template = ChatTemplate.from_tokenizer(tokenizer)
    return [session_tokens(chat, tokenizer, template, 24) for chat in knowledge_sessions(n)]


def _real_tokenizer(which: str, shared: Path) -> Tokenizer:
    if which == "smollm2":
        return load_tokenizer(shared / SMOLLM2)
    try:
        return load_tokenizer(resolve_model(QWEN))
    except KvosError as exc:
        pytest.skip(f"{QWEN} is not pulled ({exc})")


def test_pool_is_large_unique_and_concise() -> None:
    assert len(QUESTIONS) >= 60
    assert len({q for q, _ in QUESTIONS}) == len(QUESTIONS)
    for question, answer in QUESTIONS:
        assert question.endswith("?")
        sentences = len(re.findall(r"[.!?](?:\s|$)", answer))
        assert 2 <= sentences <= 5, (question, sentences)


def test_deterministic_per_seed() -> None:
    assert knowledge_sessions(10, seed=5) == knowledge_sessions(10, seed=5)
    assert knowledge_demo_session(DEMO_SEED) == knowledge_demo_session(DEMO_SEED)


def test_other_seeds_other_facts_and_questions() -> None:
    demos = [knowledge_demo_session(seed) for seed in range(8)]
    numbers = {d.probes[0].expected for d in demos}
    assert len(numbers) == 8 and all(re.fullmatch(r"[1-9]\d{3}", n) for n in numbers)
    asked = [frozenset(m["content"] for m in d.messages[3:-2:2]) for d in demos]
    assert len(set(asked)) == 8
    assert asked[0] != asked[1] and len(asked[0] & asked[1]) < QUESTIONS_PER_SESSION
    bench = knowledge_sessions(20, KNOWLEDGE_SEED)
    assert {c.probes[0].kind for c in bench} == set(BENCH_KINDS)  # the kinds are drawn in turn


def test_demo_session_is_the_14_turn_protocol() -> None:
    chat = knowledge_demo_session()
    probe = chat.probes[0]
    assert chat.turns == 14 and probe.kind == "number" and probe.distance == QUESTIONS_PER_SESSION
    assert (probe.plant_index, probe.message_index) == (1, len(chat.messages) - 2)
    assert probe.expected in chat.messages[1]["content"]
    questions = [m["content"] for m in chat.messages[3:-2:2]]
    assert len(set(questions)) == 12 and set(questions) <= {q for q, _ in QUESTIONS}
    assert all(probe.expected not in m["content"] for m in chat.messages[3:-2])


@pytest.mark.parametrize("kind", sorted(FACT_KINDS))
def test_every_fact_kind_plants_and_answers_its_value(kind: str) -> None:
    for seed in range(5):
        chat = knowledge_session(random.Random(seed), kind)
        probe = chat.probes[0]
        assert probe.expected in chat.messages[probe.plant_index]["content"]
        assert answered(chat.messages[probe.message_index + 1]["content"], probe.expected)


@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_sessions_land_in_the_token_range(which: str, shared_dir: Path) -> None:
    """12 questions with their reference answers: 1,150-1,650 tokens, each answer 50-120."""
    tokenizer = _real_tokenizer(which, shared_dir)
    sizes = _sizes(tokenizer)
    assert min(sizes) >= 1150 and max(sizes) <= 1650
    assert all(50 <= len(tokenizer.encode(answer)) <= 120 for _, answer in QUESTIONS)


def test_sessions_in_the_builtin_tokenizer() -> None:
    """The built-in model's tokenizer splits English ~1.9x finer than a BPE vocabulary: the same sessions
    are 2,200-3,100 of its tokens."""
    sizes = _sizes(load_tokenizer(builtin_model_path()))
    assert min(sizes) >= 2200 and max(sizes) <= 3100


def test_questions_before_the_fact() -> None:
    """``lead`` questions before the fact (away from the system prompt, where the first turn sits): the
    same fact, at the turn after them, the same number of questions after it, none asked twice; ``lead``
    0 is the corpus as it was (the benchmark's sessions stay what they were)."""
    for kind in BENCH_KINDS:
        plain = knowledge_session(random.Random(7), kind, 6)
        led = knowledge_session(random.Random(7), kind, 6, lead=3)
        pa, pb = plain.probes[0], led.probes[0]
        assert (pb.plant_index, pb.distance, pb.message_index) == (7, 6, pa.message_index + 6)
        assert led.messages[pb.plant_index] == plain.messages[pa.plant_index]  # the same fact, later
        assert pb.expected == pa.expected and led.messages[0] == plain.messages[0]
        asked = [
            m["content"] for i, m in enumerate(led.messages) if m["role"] == "user" and i != pb.plant_index
        ]
        assert len(asked) == len(set(asked)) == 3 + 6 + 1
    assert knowledge_sessions(8, 7, 6, lead=0) == knowledge_sessions(8, 7, 6)
    cycled = knowledge_sessions(5, 7, 6, lead=range(3))  # session i: lead i % 3
    assert [c.probes[0].plant_index for c in cycled] == [1, 3, 5, 1, 3]
    with pytest.raises(ValueError, match="lead"):
        knowledge_session(random.Random(7), "city", 6, lead=-1)
