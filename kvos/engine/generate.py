"""Generation: sample, stop on EOS, max_tokens or a stop string, and stream text deltas."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

from kvos.engine.engine import Engine
from kvos.engine.sampling import Sampler, SamplingParams
from kvos.engine.sequence import Sequence
from kvos.model.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]
ANCHOR_TOKENS = 4


@dataclass
class StreamEvent:
    """One step of a stream: the new text (possibly empty while held back) and the token just sampled
    (None for the end-of-sequence token, which is not part of the completion)."""

    text: str
    token_id: int | None
    finish_reason: FinishReason | None = None


@dataclass
class Completion:
    """The whole result of a generation."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    prompt_tokens: int = 0


class TextAssembler:
    """Turns a growing list of generated ids into text, holding back what may still change:
    an incomplete UTF-8 character, or a tail that could be the start of a stop string."""

    def __init__(self, tokenizer: Tokenizer, anchor: Seq[int], stop: Seq[str]) -> None:
        self.tokenizer = tokenizer
        self.anchor = list(anchor)[-ANCHOR_TOKENS:]
        self.anchor_text = tokenizer.decode(self.anchor) if self.anchor else ""
        self.stop = list(stop)
        self.emitted = 0
        self.text = ""

    def update(self, generated: list[int]) -> tuple[str, bool]:
        """Returns (safe new text, stop string hit). On a hit, ``self.text`` is cut before the stop string."""
        full = self.tokenizer.decode(self.anchor + generated)
        text = (
            full[len(self.anchor_text) :]
            if full.startswith(self.anchor_text)
            else self.tokenizer.decode(generated)
        )
        hit = self._find_stop(text)
        if hit is not None:
            self.text = text[:hit]
            return self._take(len(self.text)), True
        self.text = text
        return self._take(len(text) - self._held_back(text)), False

    def flush(self) -> str:
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
) -> Iterator[StreamEvent]:
    """Prefill ``prompt_ids`` into ``seq`` and yield events until a finish reason.

    The last sampled token is not fed back (its K/V are not in ``seq``): a later turn feeds it with the
    next prompt, so nothing is decoded that may be thrown away.
    """
    sampler = Sampler(params)
    assembler = TextAssembler(tokenizer, list(seq.token_ids) + list(prompt_ids), params.stop)
    eos = set() if params.ignore_eos else set(tokenizer.eos_ids)
    generated: list[int] = []
    if params.max_tokens == 0:
        yield StreamEvent("", None, "length")
        return
    logits = engine.extend(seq, prompt_ids)[0]
    while True:
        token = sampler(logits)
        if token in eos:
            yield StreamEvent(assembler.flush(), None, "stop")
            return
        generated.append(token)
        delta, hit = assembler.update(generated)
        if hit:
            yield StreamEvent(delta, token, "stop")
            return
        if len(generated) >= params.max_tokens:
            yield StreamEvent(delta + assembler.flush(), token, "length")
            return
        yield StreamEvent(delta, token)
        logits = engine.decode(seq, token)


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
