"""Generation: sample (optionally under a grammar), stop on EOS, max_tokens, a stop string or a complete
grammar, and stream text deltas with the sampled tokens' log-probabilities when asked for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvos.engine import logit_stats
from kvos.engine.constraint import Constraint
from kvos.engine.engine import Engine
from kvos.engine.sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from kvos.engine.sequence import Sequence
from kvos.errors import ConfigError
from kvos.model.tokenizer import Tokenizer
from kvos.model.vocab import speller

FinishReason = Literal["stop", "length"]
ANCHOR_TOKENS = 4


@dataclass
class StreamEvent:
    """One step of a stream: the new text (possibly empty while held back) and the token just sampled
    (None for the end-of-sequence token, which is not part of the completion), with its log-probability
    when the parameters asked for it."""

    text: str
    token_id: int | None
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = None


class TokenPicker:
    """One step's choice from the model's logits: the sampler under the grammar's mask, the log-probability
    of the pick under the model (raw logits: before bias, penalties, grammar and temperature), and whether
    the grammar is complete. End-of-sequence tokens come back as ``None``."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        """``tokenizer`` may be None only when nothing needs it: ``ignore_eos``, no grammar, no logprobs."""
        needs = not params.ignore_eos or params.grammar is not None or params.logprobs is not None
        if tokenizer is None and needs:
            raise ConfigError("end-of-sequence tokens, a grammar and logprobs need the tokenizer")
        self.params, self.sampler = params, Sampler(params)
        self.eos = set() if tokenizer is None or params.ignore_eos else set(tokenizer.eos_ids)
        self.constraint = (
            Constraint(params.grammar, tokenizer) if tokenizer and params.grammar is not None else None
        )
        self.spell = speller(tokenizer) if tokenizer and params.logprobs is not None else None

    def pick(self, logits: torch.Tensor) -> tuple[int | None, TokenLogprob | None]:
        """logits: float [vocab] (or [1, vocab]) -> (token id or None for EOS, its log-probability)."""
        allowed = self.constraint.allowed(logits.shape[-1]) if self.constraint is not None else None
        stats = logit_stats.of(logits)  # the pass runner's, on the very tensor it returned
        token = self.sampler(logits, allowed, stats)
        if token in self.eos:
            return None, None
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.params.logprobs is None:
            return token, None
        return token, token_logprob(logits, token, self.params.logprobs, self.spell, stats)

    @property
    def complete(self) -> bool:
        """True when the grammar's text is complete: the reply ends after the last pick."""
        return self.constraint is not None and self.constraint.complete


@dataclass
class Completion:
    """The whole result of a generation."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    prompt_tokens: int = 0


class TextAssembler:
    """Turns a growing list of generated ids into text, holding back what may still change:
    an incomplete UTF-8 character, or a tail that could be the start of a stop string.

    Incremental: each update decodes a window of a few ids, not the whole reply (that was O(reply) a token:
    86 us at a 1,024-token reply, 350 us at 4,096, more than the rest of a served turn). The window runs
    from ``_prefix`` (the ids whose text was settled before the last step, kept so that a tokenizer which
    spells a token by its neighbour, a leading space after BOS say, sees it) to the end; the text of
    ``[_prefix, _read)`` was already added, so the new text is what ``[_prefix, end)`` decodes to beyond
    it. While the window's text ends in an incomplete character (U+FFFD) nothing is settled and the window
    grows. Should a tokenizer ever spell the window's start differently once more ids follow, the whole
    reply is decoded once and the window starts again after it."""

    def __init__(self, tokenizer: Tokenizer, anchor: Seq[int], stop: Seq[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(anchor)[-ANCHOR_TOKENS:]  # the anchor, then every generated id seen
        self.anchor = len(self.ids)
        self.anchor_text = tokenizer.decode(self.ids) if self.ids else ""
        self.stop = list(stop)
        self.emitted = 0
        self.text = ""  # the reply's text so far (cut before a stop string once one is hit)
        self._prefix, self._read = 0, self.anchor
        self._stopped = False  # a stop string was hit: the text ends there

    def update(self, generated: list[int]) -> tuple[str, bool]:
        """Returns (safe new text, stop string hit). On a hit, ``self.text`` is cut before the stop string."""
        self.ids += generated[len(self.ids) - self.anchor :]
        self._settle(final=False)
        text = self.text
        hit = self._find_stop(text)
        if hit is not None:
            self.text, self._stopped = text[:hit], True
            return self._take(len(self.text)), True
        return self._take(len(text) - self._held_back(text)), False

    def _settle(self, final: bool) -> None:
        """Add the text of the ids past ``_read`` once it is complete (``final``: whatever it is)."""
        if self._stopped or self._read == len(self.ids):
            return
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if not final and window.endswith("\ufffd"):
            return  # half a character: wait for the ids that complete it
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        if window.startswith(before):
            self.text += window[len(before) :]
        else:  # the window's start reads differently now: decode the reply whole, as before windows
            full = self.tokenizer.decode(self.ids)
            if full.startswith(self.anchor_text):
                self.text = full[len(self.anchor_text) :]
            else:
                self.text = self.tokenizer.decode(self.ids[self.anchor :])
        self._prefix, self._read = self._read, len(self.ids)

    def flush(self) -> str:
        """The text not yet emitted, an incomplete character's U+FFFD included (the reply ended)."""
        self._settle(final=True)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.emitted : max(upto, self.emitted)]
        self.emitted += len(delta)
        return delta

    def _find_stop(self, text: str) -> int | None:
        longest = max((len(s) for s in self.stop), default=0)
        window_start = max(0, self.emitted - longest)
        hits = [i for s in self.stop if (i := text.find(s, window_start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held


def stream(
    engine: Engine,
    seq: Sequence,
    prompt_ids: Seq[int],
    params: SamplingParams,
    tokenizer: Tokenizer,
    after_extend: Callable[[Sequence], object] | None = None,
) -> Iterator[StreamEvent]:
    """Prefill ``prompt_ids`` into ``seq`` and yield events until a finish reason; ``after_extend(seq)``
    runs after the prefill and after every token fed (K/V compression, ``kvos generate --kv-compression``).

    The last sampled token is not fed back (its K/V are not in ``seq``): a later turn feeds it with the
    next prompt, so nothing is decoded that may be thrown away.
    """
    picker = TokenPicker(params, tokenizer)
    assembler = TextAssembler(tokenizer, list(seq.token_ids) + list(prompt_ids), params.stop)
    if params.max_tokens == 0:
        yield StreamEvent("", None, "length")
        return
    logits = engine.extend(seq, prompt_ids)[0]

    def feed(token: int) -> torch.Tensor:
        out = engine.decode(seq, token)
        if after_extend is not None:
            after_extend(seq)
        return out

    if after_extend is not None:
        after_extend(seq)
    yield from decode_loop(logits, feed, picker, assembler, params.max_tokens)


def decode_loop(
    logits: torch.Tensor,
    feed: Callable[[int], torch.Tensor],
    picker: TokenPicker,
    assembler: TextAssembler | None,
    max_tokens: int,
    feed_last: bool = False,
) -> Iterator[StreamEvent]:
    """The decode loop of every generation: a session's reply (the server, the demo), :func:`stream`
    (``kvos generate``) and the answer signal's null answer.

    Picks a token from ``logits`` (float [vocab] or [1, vocab]), yields its event, then feeds it
    (``feed(token)`` returns the next logits) unless the event ended the reply; with ``feed_last`` the
    ending token is fed too, so the cache holds the whole reply. A consumer that stops at an event leaves
    that event's token unfed. ``assembler`` None: no text (events carry tokens only)."""
    generated: list[int] = []
    if max_tokens == 0:
        yield StreamEvent("", None, "length")
        return
    while True:
        token, logprob = picker.pick(logits)
        if token is None:
            yield StreamEvent(assembler.flush() if assembler is not None else "", None, "stop")
            return
        generated.append(token)
        event = next_event(assembler, generated, picker, max_tokens, logprob)
        yield event
        if event.finish_reason is None or feed_last:
            logits = feed(token)
        if event.finish_reason is not None:
            return


def next_event(
    assembler: TextAssembler | None,
    generated: list[int],
    picker: TokenPicker,
    max_tokens: int,
    logprob: TokenLogprob | None,
) -> StreamEvent:
    """The event for the token just appended to ``generated``: its text, and the finish reason if it ends
    the reply (a stop string, a complete grammar, or ``max_tokens``)."""
    token = generated[-1]
    delta, hit = assembler.update(generated) if assembler is not None else ("", False)
    rest = assembler.flush if assembler is not None else str
    if hit:
        return StreamEvent(delta, token, "stop", logprob)
    if picker.complete:
        return StreamEvent(delta + rest(), token, "stop", logprob)
    if len(generated) >= max_tokens:
        return StreamEvent(delta + rest(), token, "length", logprob)
    return StreamEvent(delta, token, None, logprob)


def generate(
    engine: Engine,
    seq: Sequence,
    prompt_ids: Seq[int],
    params: SamplingParams,
    tokenizer: Tokenizer,
) -> Completion:
    """Run :func:`stream` to the end and collect the result."""
    parts: list[str] = []
    ids: list[int] = []
    reason: FinishReason = "length"
    for event in stream(engine, seq, prompt_ids, params, tokenizer):
        parts.append(event.text)
        if event.token_id is not None:
            ids.append(event.token_id)
        reason = event.finish_reason or reason
    return Completion("".join(parts), ids, reason, len(prompt_ids))
