"""The "answer" recovery signal: how much a saved message changes what the model would answer.

For a new user message ``q`` the model first answers it with only the session's sinks in front (greedy, at
most ``max_new`` tokens, end of turn included): the null answer ``a``. Each saved message ``c`` is then
scored by how much less likely ``a`` becomes once ``c`` stands before ``q``::

    score(c) = log p(a | sinks, q) - log p(a | sinks, c, q)        (nats, teacher-forced)

A message that holds what ``q`` asks for changes the answer (with "For a living I work as a translator"
in front, "You have not told me your job." becomes far less likely), an unrelated one leaves it as it was.
Unlike a lexical or embedding match it needs no shared words: it asks the model that will answer.

Cost per user message: one greedy decode of at most ``max_new`` tokens and one forward pass of
``|sinks| + |c| + |q| + |a|`` tokens per candidate message, on scratch sequences of the session's engine
(released at once; their pool blocks count against nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from kvos.engine.engine import Engine
from kvos.engine.generate import TokenPicker, decode_loop
from kvos.engine.sampling import SamplingParams
from kvos.session.queries import QueryTap

K = TypeVar("K")


class AnswerContrast:
    """Scores candidate messages for a new user message (see the module docstring).

    ``generation_prompt``: the tokens that open an assistant turn (the chat template's generation prompt,
    ``<|im_start|>assistant\\n`` for ChatML; empty without a template). ``eos_ids``: tokens that end the
    null answer.
    """

    def __init__(
        self, engine: Engine, generation_prompt: Sequence[int], eos_ids: Sequence[int], max_new: int = 10
    ) -> None:
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        self.engine, self.generation_prompt = engine, list(generation_prompt)
        self.eos_ids, self.max_new = frozenset(eos_ids), max_new

    def base(self, prefix: Sequence[int], query: Sequence[int]) -> list[int]:
        """The context of the null answer: ``prefix``, ``query``, the generation prompt."""
        return [*prefix, *query, *self.generation_prompt]

    def scores(
        self,
        prefix: Sequence[int],
        query: Sequence[int],
        candidates: Mapping[K, Sequence[int]],
        answer: Sequence[int] | None = None,
    ) -> dict[K, float]:
        """``score(c)`` in nats for every candidate (token ids of a message), keyed as given. ``prefix``:
        what stays in front of everything (the sinks); ``query``: the new user message's tokens;
        ``answer``: the null answer, if :meth:`null_answer` already gave it."""
        base = self.base(prefix, query)
        answer = list(answer) if answer is not None else self.null_answer(base)
        reference = self.log_likelihood(base, answer)
        return {
            key: reference - self.log_likelihood([*prefix, *tokens, *query, *self.generation_prompt], answer)
            for key, tokens in candidates.items()
        }

    def scratch_tokens(
        self, prefix: Sequence[int], query: Sequence[int], candidates: Iterable[Sequence[int]]
    ) -> int:
        """The longest scratch sequence :meth:`scores` of these candidates holds at once (its passes run
        one after another, each on a sequence of its own): the largest candidate's context and the longest
        null answer."""
        longest = max((len(tokens) for tokens in candidates), default=0)
        return len(self.base(prefix, query)) + longest + self.max_new

    def null_answer(self, context: Sequence[int], tap: QueryTap | None = None) -> list[int]:
        """Greedy continuation of ``context`` (non-empty): at most ``max_new`` tokens, stopping after an
        end-of-turn token, which is kept (its probability is part of the answer's; a reply drops it). With
        ``tap``, the queries of the context and of the answer's tokens but the last go to it (at positions
        0, 1, ...)."""
        picker = TokenPicker(SamplingParams(max_tokens=self.max_new, ignore_eos=True), None)  # greedy
        seq = self.engine.new_sequence()
        layers = tap.wanted if tap is not None else frozenset()

        def run(ids: list[int]) -> torch.Tensor:
            start = seq.num_tokens
            positions = torch.arange(start, start + len(ids))
            queries = tap.add(positions) if tap is not None else None
            return self.engine.extend(seq, ids, positions.tolist(), query_layers=layers, queries=queries)

        out: list[int] = []
        try:
            with torch.no_grad():
                first = run(list(context))
                for event in decode_loop(first, lambda t: run([t])[0], picker, None, self.max_new):
                    assert event.token_id is not None  # no end-of-sequence token ends it (ignore_eos)
                    out.append(event.token_id)
                    if event.token_id in self.eos_ids:
                        break
                return out
        finally:
            self.engine.release(seq)

    def log_likelihood(self, context: Sequence[int], answer: Sequence[int]) -> float:
        """log p(answer | context) in nats, teacher-forced in one forward pass (both non-empty)."""
        seq = self.engine.new_sequence()
        try:
            with torch.no_grad():
                ids = [*context, *answer[:-1]]
                logits = self.engine.extend(seq, ids, logits="all")[len(context) - 1 :]  # [len(answer), V]
        finally:
            self.engine.release(seq)
        logp = torch.log_softmax(logits.double(), dim=-1)
        return float(logp.gather(1, torch.tensor(list(answer), device=logp.device)[:, None]).sum())
