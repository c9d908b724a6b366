"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded; logit bias, presence and
frequency penalties, an optional grammar mask; the log-probabilities of what was picked."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvos.errors import ConfigError

if TYPE_CHECKING:
    from kvos.engine.constraint import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy.

    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI's formula over the tokens generated so far;
    ``logit_bias`` adds to the logits of the given token ids; ``logprobs`` (None: off) asks for the chosen
    token's log-probability and that many top alternatives; ``grammar`` constrains the text.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ConfigError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ConfigError(f"logprobs must be in [0, 20] top alternatives, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits change before the pick (penalties or bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class Scored:
    """A token with its log-probability under the model, and the bytes it adds to the text."""

    token_id: int
    logprob: float
    piece: bytes = b""


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token and the most likely tokens at its position, each with its log-probability."""

    chosen: Scored
    top: list[Scored]


class Sampler:
    """Draws one token id from a logits vector according to :class:`SamplingParams`; with penalties it
    counts the tokens it has returned (the tokens generated so far)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.counts: torch.Tensor | None = None  # float [vocab]: times each token was generated

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """logits: float [vocab] (or [1, vocab]); allowed: bool [vocab] or None -> token id."""
        logits = logits.reshape(-1).float()
        if self.params.adjusts_logits:
            logits = self.adjust(logits)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        scaled = None if self.params.greedy else logits / self.params.temperature
        if scaled is None or _overflowed(scaled):
            # greedy, or a temperature so small that the logits overflowed: the limit of sampling is argmax
            token = int(torch.argmax(logits).item())
        else:
            probs = filtered_probs(scaled, self.params.top_k, self.params.top_p)
            token = int(torch.multinomial(probs.cpu(), 1, generator=self.generator).item())
        if self.params.presence_penalty or self.params.frequency_penalty:
            self._count(token, logits.shape[0])
        return token

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """OpenAI's ``mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty`` (c[j]: how often
        token j was generated so far), plus ``logit_bias``. logits: float [vocab] -> float [vocab]."""
        p = self.params
        out = logits.clone()
        for token_id, bias in p.logit_bias.items():
            if 0 <= token_id < out.shape[0]:
                out[token_id] += bias
        if self.counts is not None:
            counts = self.counts.to(out.device)
            out -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
        return out

    def _count(self, token: int, vocab: int) -> None:
        if self.counts is None:
            self.counts = torch.zeros(vocab)
        self.counts[token] += 1


def _overflowed(scaled: torch.Tensor) -> bool:
    """Logits divided by a tiny temperature that softmax cannot take: a NaN or +inf, or every token at -inf
    (all the allowed logits were negative)."""
    return bool(torch.isnan(scaled).any() | torch.isposinf(scaled).any() | ~torch.isfinite(scaled).any())


def token_logprob(
    logits: torch.Tensor, token: int, top: int, spell: Callable[[int], bytes] | None = None
) -> TokenLogprob:
    """The model's log-softmax at ``token`` and at its ``top`` most likely tokens, spelled by ``spell``
    (token id -> bytes). logits: float [vocab]."""
    logp = torch.log_softmax(logits.reshape(-1).float(), dim=-1)

    def scored(token_id: int, value: float) -> Scored:
        return Scored(token_id, value, spell(token_id) if spell is not None else b"")

    best = torch.topk(logp, top) if top > 0 else None
    pairs = [] if best is None else zip(best.indices.tolist(), best.values.tolist(), strict=True)
    return TokenLogprob(scored(token, float(logp[token].item())), [scored(t, v) for t, v in pairs])


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of logits [vocab] kept to the top-k tokens and the smallest nucleus holding top_p mass (at
    least the most likely token, however small top_p is)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= top_p
        drop[..., 0] = False  # a top_p below float32's smallest value rounds to 0, which would drop them all
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
