"""Held-out quality of the built-in model with a full cache (no eviction), run through kvos itself.

Each held-out session (``corpus.heldout_sessions``, a seed the training corpus does not use) is played
through kvos's :class:`Engine` turn by turn with the model's chat template and greedy decoding: by default
the model writes every assistant reply itself, as in a live chat (``replies="reference"`` feeds the corpus'
reference replies instead and only generates the last one). The last user turn asks for a fact planted
earlier; it counts as answered when the fact string appears in the reply as a whole token (not inside a
longer number or word). The pass rate comes with its Wilson 95% interval.

``python -m kvos.builtin.evaluate [--model DIR] [--n 200] [--seed S] [--replies model|reference] [--json P]``
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kvos.builtin import builtin_model_path
from kvos.builtin.corpus import HELDOUT_SEED, ChatSession, Message, heldout_sessions
from kvos.engine.engine import Engine
from kvos.engine.generate import generate
from kvos.engine.sampling import SamplingParams
from kvos.engine.sequence import Sequence
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, load_tokenizer

Replies = Literal["model", "reference"]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def answered(reply: str, expected: str) -> bool:
    """Whether ``expected`` appears in ``reply``, not as part of a longer word or number; an expected answer
    that ends in a number may be said as an ordinal ("April 5" as "April 5th")."""
    ordinal = "(?:st|nd|rd|th)?" if expected[-1:].isdigit() else ""
    pattern = rf"(?<![A-Za-z0-9]){re.escape(expected)}{ordinal}(?![A-Za-z0-9])"
    return re.search(pattern, reply) is not None


class Chat:
    """One conversation in the engine: each turn feeds only the tokens the cache does not hold yet."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, template: ChatTemplate, max_tokens: int) -> None:
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.params = SamplingParams(max_tokens=max_tokens)
        self.seq: Sequence = engine.new_sequence()
        self.reprefills = 0

    def reply(self, messages: list[Message]) -> str:
        """Greedy reply to ``messages`` (the cache must hold a prefix of their rendering, or is rebuilt)."""
        ids = self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))
        have = self.seq.token_ids
        if ids[: len(have)] != have:  # a reply re-tokenized differently: start over from the text
            self.engine.release(self.seq)
            self.seq, have = self.engine.new_sequence(), []
            self.reprefills += 1
        return generate(self.engine, self.seq, ids[len(have) :], self.params, self.tokenizer).text

    def close(self) -> None:
        self.engine.release(self.seq)


@dataclass(frozen=True)
class ProbeResult:
    kind: str
    distance: int
    expected: str
    reply: str
    answered: bool
    prompt_tokens: int


@dataclass
class Report:
    model: str
    replies: str
    n: int
    passed: int
    pass_rate: float
    ci_low: float
    ci_high: float
    seconds: float
    by_distance: dict[int, tuple[int, int]] = field(default_factory=dict)  # distance -> (passed, n)
    results: list[ProbeResult] = field(default_factory=list)


def play(chat: Chat, session: ChatSession, replies: Replies) -> ProbeResult:
    """Play ``session`` up to its scored probe and return the model's answer to it."""
    probe = session.probes[0]
    history: list[Message] = [session.messages[0]]
    for index in range(1, probe.message_index + 1):
        message = session.messages[index]
        if message["role"] != "user":
            continue
        history.append(message)
        if index == probe.message_index or replies == "model":
            text = chat.reply(history)
        else:
            text = session.messages[index + 1]["content"]
        history.append({"role": "assistant", "content": text})
    prompt_tokens = chat.seq.num_tokens
    return ProbeResult(probe.kind, probe.distance, probe.expected, text, answered(text, probe.expected),
                       prompt_tokens)  # fmt: skip


def evaluate(
    model_path: str | Path | None = None,
    n: int = 200,
    seed: int = HELDOUT_SEED,
    replies: Replies = "model",
    max_tokens: int = 24,
) -> Report:
    """Pass rate of ``n`` held-out probes with a full cache, and its Wilson 95% interval."""
    path = Path(model_path) if model_path else builtin_model_path()
    engine = Engine(load_model(path))
    tokenizer = load_tokenizer(path)
    template = ChatTemplate.from_tokenizer(tokenizer)
    start = time.perf_counter()
    results = []
    for session in heldout_sessions(n, seed):
        chat = Chat(engine, tokenizer, template, max_tokens)
        results.append(play(chat, session, replies))
        chat.close()
    passed = sum(r.answered for r in results)
    low, high = wilson_interval(passed, n)
    by_distance: dict[int, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for r in results:
        ok, count = by_distance[r.distance]
        by_distance[r.distance] = (ok + r.answered, count + 1)
    seconds = round(time.perf_counter() - start, 1)
    return Report(str(path), replies, n, passed, passed / max(n, 1), low, high, seconds,
                  dict(sorted(by_distance.items())), results)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Held-out probe accuracy of the built-in model (full cache)."
    )
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--n", type=int, default=200, help="number of held-out sessions")
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--replies", choices=["model", "reference"], default="model")
    parser.add_argument("--json", type=Path, default=None, help="write the report (with every reply) here")
    args = parser.parse_args(argv)
    report = evaluate(args.model, args.n, args.seed, args.replies)
    print(f"{report.passed}/{report.n} probes answered = {report.pass_rate:.3f} "
          f"(Wilson 95%: {report.ci_low:.3f}-{report.ci_high:.3f}), replies={report.replies}, "
          f"{report.seconds}s")  # fmt: skip
    print("by distance: " + ", ".join(f"{d}: {ok}/{k}" for d, (ok, k) in report.by_distance.items()))
    for r in report.results:
        if not r.answered:
            print(f"  missed {r.kind} (distance {r.distance}): expected {r.expected!r}, got {r.reply!r}")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
