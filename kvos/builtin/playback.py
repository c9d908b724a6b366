"""Play a corpus conversation through a memory-managed session: the reference replies are fed as they are
(teacher forcing) and the model answers only the scored probe, so a probe is answered if and only if the
memory kept, or brought back, what the answer needs. Live, the model writes every reply itself instead, as
in a real chat (``kvos demo`` on a pretrained model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvos.builtin.corpus import ChatSession
from kvos.builtin.evaluate import answered
from kvos.engine.sampling import SamplingParams
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import Tokenizer
from kvos.session.session import Session


@dataclass
class Played:
    reply: str
    expected: str
    recalled: bool
    turns: list[dict[str, Any]] = field(default_factory=list)
    fact_in_cache: bool = False  # every chunk of the message that planted the fact was resident at the probe


def session_tokens(chat: ChatSession, tokenizer: Tokenizer, template: ChatTemplate, max_tokens: int) -> int:
    """Tokens of the whole conversation up to the probe, with the answer: the session's size."""
    messages = chat.messages[: chat.probes[0].message_index + 1]
    return len(tokenizer.encode(template.render(messages, add_generation_prompt=True))) + max_tokens


COUNTERS = (
    "turn",
    "active_tokens",
    "cached_tokens",
    "history_tokens",
    "evictions",
    "recoveries_restore",
    "recoveries_recompute",
)  # the session's memory counters recorded after every user turn


def play(
    session: Session,
    chat: ChatSession,
    max_tokens: int = 24,
    on_turn: Callable[[dict[str, Any]], None] | None = None,
    replies: SamplingParams | None = None,
) -> Played:
    """Run the conversation up to its probe; per user turn record the session's memory counters; whether
    the fact was in the cache when the probe was answered (what the memory did, whatever the model then
    answers). ``replies``: live, the model writes each reply between the plant and the probe, sampled
    with these parameters (its text in each turn's ``reply``), and the plant's reference acknowledgement is
    fed; None: every reference reply is fed. The probe's answer is greedy, at most ``max_tokens``."""
    probe = chat.probes[0]
    first = chat.messages[0]
    session.add_message(first["role"], first["content"])
    reply, turns, fact_in_cache = "", [], False
    for index in range(1, probe.message_index + 1):
        message = chat.messages[index]
        if message["role"] != "user":
            continue
        session.add_message("user", message["content"])
        if index == probe.message_index:
            planted = [c for c in session.chunks.values() if c.message_index == probe.plant_index]
            fact_in_cache = bool(planted) and all(c.resident for c in planted)
            reply = session.generate(SamplingParams(max_tokens=max_tokens))[0]
            extra: dict[str, Any] = {"answer": reply}
        else:
            live = None if index == probe.plant_index else replies
            extra = {"answer": None, **_reply(session, chat.messages[index + 1]["content"], live)}
        stats = session.stats()
        record = {**{k: stats[k] for k in COUNTERS}, **extra}
        turns.append(record)
        if on_turn is not None:
            on_turn(record)
    return Played(reply, probe.expected, answered(reply, probe.expected), turns, fact_in_cache)


def _reply(session: Session, reference: str, replies: SamplingParams | None) -> dict[str, str]:
    """The assistant's turn before the probe: the reference fed as it is (``replies`` None; returns {}), or
    the model's own reply sampled with ``replies`` (returns {"reply": its text})."""
    if replies is None:
        session.add_message("assistant", reference)
        return {}
    return {"reply": session.generate(replies)[0]}
