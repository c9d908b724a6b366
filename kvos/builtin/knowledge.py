"""Planted-fact sessions for pretrained chat models: a personal fact, general-knowledge questions, the probe.

The built-in corpus (:mod:`kvos.builtin.corpus`) was written for kvos's own small model: its filler replies
are short and formulaic. These sessions are what a user of a pretrained assistant types: at turn 1 a fact
about themselves ("My favourite number is 4242."), then ``questions`` unrelated general-knowledge questions
(:mod:`kvos.builtin.knowledge_pool`, each with a 2-5 sentence reference answer), then the probe ("What is my
favourite number?"), whose reference answer quotes the fact. With the default 12 questions that is the
14-turn protocol of the original demonstration, about 1,150-1,650 tokens in a common BPE tokenizer.

The fact kinds are ones a pretrained assistant answers from a full cache: personal details, never codes,
passwords or secrets (Qwen2.5-Coder-0.5B-Instruct refuses those once a session passes ~1,400 tokens).
Everything is drawn from one ``random.Random(seed)``: another seed gives other values and other questions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvos.builtin.corpus import (
    CITIES,
    DEMO_SEED,
    MONTHS,
    NAMES,
    PET_NAMES,
    SPECIES,
    ChatSession,
    Message,
    Probe,
)
from kvos.builtin.knowledge_pool import QUESTIONS

KNOWLEDGE_SEED = 20_261_125  # the recall benchmark's sessions; the demo's is corpus.DEMO_SEED
QUESTIONS_PER_SESSION = 12
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly, knowledgeable assistant.",
    "You are a helpful assistant. Keep your answers short and clear.",
)
# The demo's: the model writes its own replies there, and asked for detail they fill their length cap, so the
# session grows past the budget (Qwen2.5-Coder-0.5B's replies are ~60-80 tokens when not asked).
DEMO_SYSTEM_PROMPT = "You are a knowledgeable assistant. Answer every question in detail, with examples."
# The demo's acknowledgement of the fact (fed, not written by the model: Qwen2.5-Coder-0.5B answered "My
# favourite number is 8701." with "As an AI language model, I don't have personal preferences ... so I don't
# have a favorite number." and gave that answer again at the probe, from a full cache). It does not repeat the
# number, so the fact lives in one message.
DEMO_ACK = "Got it, I'll remember that."
ACKS = (
    "Got it, I'll remember that.",
    "Thanks for telling me! I'll keep that in mind.",
    "Noted. What would you like to talk about?",
)

Fields = dict[str, str]  # "v": the value an answer must quote; other keys fill the templates


@dataclass(frozen=True)
class FactKind:
    """How one kind of personal fact is drawn, planted, asked for and answered; the templates take the
    fields :attr:`draw` returns."""

    draw: Callable[[random.Random], Fields]
    plants: tuple[str, ...]
    probes: tuple[str, ...]
    answer: str


def _number(rng: random.Random) -> Fields:
    return {"v": str(rng.randint(1000, 9999))}


def _parking(rng: random.Random) -> Fields:
    return {"v": str(rng.randint(10, 199)), "level": str(rng.randint(1, 9))}


def _pet(rng: random.Random) -> Fields:
    return {"v": rng.choice(PET_NAMES), "species": rng.choice(SPECIES)}


def _birthday(rng: random.Random) -> Fields:
    return {"v": f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"}


FACT_KINDS: dict[str, FactKind] = {
    "number": FactKind(
        _number,
        ("My favourite number is {v}.", "Before we start, something about me: my favourite number is {v}.",
         "Please remember that my favourite number is {v}."),
        ("What is my favourite number?", "What did I say my favourite number is?"),
        "Your favourite number is {v}.",
    ),
    "parking": FactKind(
        _parking,
        ("I just parked my car on level {level}, spot {v}.",
         "Quick note before my questions: I parked on level {level}, spot {v}."),
        ("Where did I park my car?", "Which level and spot did I park in?"),
        "You parked on level {level}, spot {v}.",
    ),
    "pet": FactKind(
        _pet,
        ("My {species} is called {v}.", "I have a {species} at home, and she is called {v}."),
        ("What is my {species} called?", "What is the name of my {species}?"),
        "Your {species} is called {v}.",
    ),
    "city": FactKind(
        lambda r: {"v": r.choice(CITIES)},
        ("I live in {v}.", "A little about me: I live in {v}."),
        ("Which city do I live in?", "Where do I live?"),
        "You live in {v}.",
    ),
    "name": FactKind(
        lambda r: {"v": r.choice(NAMES)},
        ("Hi! My name is {v}.", "Hello, I'm {v}. Nice to meet you."),
        ("What is my name?", "What did I tell you my name is?"),
        "Your name is {v}.",
    ),
    "birthday": FactKind(
        _birthday,
        ("My birthday is on {v}.", "By the way, my birthday is on {v}."),
        ("When is my birthday?", "On which day is my birthday?"),
        "Your birthday is on {v}.",
    ),
    "locker": FactKind(
        lambda r: {"v": str(r.randint(10, 399))},
        ("My locker at the gym is number {v}.", "At the gym I always use locker {v}."),
        ("What is my gym locker number?", "Which locker do I use at the gym?"),
        "Your gym locker is number {v}.",
    ),
    "sister": FactKind(
        lambda r: {"v": r.choice(NAMES)},
        ("My sister's name is {v}.", "I have a sister called {v}."),
        ("What is my sister's name?", "What is my sister called?"),
        "Your sister's name is {v}.",
    ),
}  # fmt: skip
# The kinds kvos bench recall draws from: all of the above, answered by Qwen2.5-Coder-0.5B-Instruct from a
# full cache in 26 of 26 screening sessions. Dropped there: a hotel room number ("My hotel room number is
# 716."), declined in 3 of 4 sessions with the number in the context ("I'm sorry, but I don't have enough
# information to answer your question. Could you please provide more context or information about your
# hotel room number?").
BENCH_KINDS: tuple[str, ...] = tuple(FACT_KINDS)


def _turn(user: str, assistant: str) -> list[Message]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def knowledge_session(
    rng: random.Random,
    kind: str,
    questions: int = QUESTIONS_PER_SESSION,
    system: str | None = None,
    lead: int = 0,
) -> ChatSession:
    """One session: ``lead`` knowledge questions (default none), a fact of ``kind`` (at turn ``lead + 1``),
    ``questions`` more distinct knowledge questions with their reference answers, then the probe
    (``probes[0]``), whose answer must quote the fact's value. ``system``: the system prompt (default: one
    drawn from :data:`SYSTEM_PROMPTS`). The draws of ``lead`` 0 are those of before it existed."""
    if not 0 <= questions + lead <= len(QUESTIONS) or lead < 0:
        raise ValueError(f"questions + lead must be 0-{len(QUESTIONS)}, got {questions} + {lead}")
    fact = FACT_KINDS[kind]
    fields = fact.draw(rng)
    answer = fact.answer.format(**fields)
    ack = rng.choice(ACKS) if rng.random() < 0.5 else f"Got it! {answer}"
    drawn = rng.choice(SYSTEM_PROMPTS)
    messages: list[Message] = [{"role": "system", "content": drawn if system is None else system}]
    plant = rng.choice(fact.plants).format(**fields)
    asked = rng.sample(QUESTIONS, lead + questions)
    for question, reference in asked[questions:]:
        messages += _turn(question, reference)
    messages += _turn(plant, ack)
    for question, reference in asked[:questions]:
        messages += _turn(question, reference)
    messages += _turn(rng.choice(fact.probes).format(**fields), answer)
    probe = Probe(len(messages) - 2, 1 + 2 * lead, kind, fields["v"], questions)
    return ChatSession(messages, [probe])


def knowledge_sessions(
    n: int,
    seed: int = KNOWLEDGE_SEED,
    questions: int = QUESTIONS_PER_SESSION,
    kinds: tuple[str, ...] = BENCH_KINDS,
    lead: int | Sequence[int] = 0,
) -> list[ChatSession]:
    """``n`` sessions drawn from ``random.Random(seed)``, each with a fact of one of ``kinds`` (drawn in
    turn, in a shuffled order) after ``lead`` knowledge questions and before ``questions`` more. A sequence
    ``lead`` gives session ``i`` the lead ``lead[i % len(lead)]`` (facts said at several points of a
    conversation, as calibration wants them)."""
    leads = [lead] if isinstance(lead, int) else list(lead)
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    return [
        knowledge_session(rng, order[i % len(order)], questions, lead=leads[i % len(leads)]) for i in range(n)
    ]


def knowledge_demo_session(seed: int = DEMO_SEED, questions: int = QUESTIONS_PER_SESSION) -> ChatSession:
    """The demo on a pretrained model: the user's favourite number (4 digits) at turn 1, ``questions``
    knowledge questions, the probe at the last turn (turn 14 with the default 12); the system prompt asks
    for detailed answers (:data:`DEMO_SYSTEM_PROMPT`) and the fact is acknowledged with :data:`DEMO_ACK`."""
    chat = knowledge_session(random.Random(seed), "number", questions, DEMO_SYSTEM_PROMPT)
    chat.messages[2] = {"role": "assistant", "content": DEMO_ACK}
    return chat
