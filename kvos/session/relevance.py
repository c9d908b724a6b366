"""The "answer" recovery signal: how much a saved message changes what the model would answer.

For a new user message ``q`` the model first answers it with only the session's sinks in front (greedy, at
most ``max_new`` tokens, end of turn included): the null answer ``a``. Each saved message ``c`` is then
scored by how much less likely ``a`` becomes once ``c`` stands before ``q``::

    score(c) = log p(a | sinks, q) - log p(a | sinks, c, q)        (nats, teacher-forced)

A message that holds what ``q`` asks for changes the answer (with "For a living I work as a translator"
in front, "You have not told me your job." becomes far less likely), an unrelated one leaves it as it was.
Unlike a lexical or embedding match it needs no shared words: it asks the model that will answer.

Cost per user message: one greedy decode of at most ``max_new`` tokens and one teacher-forced pass of
``|sinks| + |c| + |q| + |a|`` tokens per candidate message, on scratch sequences of the session's engine
(released at once; their pool blocks count against nothing); the passes share forward passes, as many
together as fit in ``pack_tokens`` (the projections and the MLP then read the weights once for all of them).
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
        self,
        engine: Engine,
        generation_prompt: Sequence[int],
        eos_ids: Sequence[int],
        max_new: int = 10,
        pack_tokens: int | None = None,
    ) -> None:
        """``pack_tokens``: the most pool tokens (whole blocks) the teacher-forced passes of one forward
        pass hold together (None: the engine's slice); a pass longer than that runs alone."""
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        if pack_tokens is not None and pack_tokens < 1:
            raise ValueError(f"pack_tokens must be >= 1, got {pack_tokens}")
        self.engine, self.generation_prompt = engine, list(generation_prompt)
        self.eos_ids, self.max_new, self.pack_tokens = frozenset(eos_ids), max_new, pack_tokens

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
        ``answer``: the null answer, if :meth:`null_answer` already gave it. The reference pass and the
        candidates' passes run packed together (:meth:`log_likelihoods`)."""
        base = self.base(prefix, query)
        answer = list(answer) if answer is not None else self.null_answer(base)
        keys = list(candidates)
        contexts = [base, *([*prefix, *candidates[k], *query, *self.generation_prompt] for k in keys)]
        reference, *each = self.log_likelihoods(contexts, answer)
        return {key: reference - value for key, value in zip(keys, each, strict=True)}

    def scratch_tokens(
        self, prefix: Sequence[int], query: Sequence[int], candidates: Iterable[Sequence[int]]
    ) -> int:
        """The most pool tokens (whole blocks) the scratch sequences of :meth:`scores` hold at once: the
        null answer's, or the largest pack of teacher-forced passes (at most ``pack_tokens``, or one
        pass alone when it is longer)."""
        base = len(self.base(prefix, query))
        lengths = [base + self.max_new - 1, *(base + len(c) + self.max_new - 1 for c in candidates)]
        limit = self.pack_tokens if self.pack_tokens is not None else self.engine.prefill_slice
        packed = max(sum(self._blocked(lengths[i]) for i in pack) for pack in self.packs(lengths, limit))
        return max(self._blocked(base + self.max_new), packed)

    def packs(self, lengths: Sequence[int], limit: int | None = None) -> list[list[int]]:
        """Passes of these token ``lengths`` grouped, in order, into forward passes whose sequences'
        whole blocks fit in ``limit`` (default: ``pack_tokens`` and the engine's current slice); a pass
        over the limit is a pack of its own. -> the indices of each pack."""
        if limit is None:
            limit = self.engine.slice_tokens()
            limit = limit if self.pack_tokens is None else min(limit, self.pack_tokens)
        packs: list[list[int]] = []
        used = 0
        for i, n in enumerate(lengths):
            if packs and used + self._blocked(n) <= limit:
                packs[-1].append(i)
                used += self._blocked(n)
            else:
                packs.append([i])
                used = self._blocked(n)
        return packs

    def _blocked(self, tokens: int) -> int:
        """``tokens`` rounded up to whole pool blocks (a scratch sequence starts a block of its own)."""
        size = self.engine.pool.layout.block_size
        return -(-tokens // size) * size

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

    def log_likelihoods(self, contexts: Sequence[Sequence[int]], answer: Sequence[int]) -> list[float]:
        """``log p(answer | context)`` in nats for every context (all non-empty), teacher-forced, on
        scratch sequences released at once: the passes grouped by :meth:`packs`, each pack one forward
        pass (:meth:`Engine.step`; a lone pass over the slice is sliced by :meth:`Engine.extend`), the
        vocabulary head applied to the answer's rows only."""
        rows = [[*context, *answer[:-1]] for context in contexts]
        target = torch.tensor(list(answer))
        out: list[float] = []
        for pack in self.packs([len(r) for r in rows]):
            seqs = [self.engine.new_sequence() for _ in pack]
            try:
                with torch.no_grad():
                    if len(pack) == 1:
                        hidden = [self.engine.extend(seqs[0], rows[pack[0]], logits="none")]
                    else:
                        work = [(seq, rows[i]) for seq, i in zip(seqs, pack, strict=True)]
                        hidden = self.engine.step(work, logits="none")
            finally:
                for seq in seqs:
                    self.engine.release(seq)
            states = torch.cat([h[len(contexts[i]) - 1 :] for h, i in zip(hidden, pack, strict=True)])
            logp = torch.log_softmax(self.engine.model.head(states).double(), dim=-1)  # [pack x |a|, V]
            picked = logp.view(len(pack), len(answer), -1).gather(
                2, target.to(logp.device)[None, :, None].expand(len(pack), -1, 1)
            )
            out.extend(picked.sum(dim=(1, 2)).tolist())
        return out
