"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvos.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Sampler:
    """Draws one token id from a logits vector according to :class:`SamplingParams`."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: float [vocab] (or [1, vocab]) -> token id."""
        logits = logits.reshape(-1).float()
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        probs = filtered_probs(logits / self.params.temperature, self.params.top_k, self.params.top_p)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator).item())


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of logits [vocab] kept to the top-k tokens and the smallest nucleus holding top_p mass."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
