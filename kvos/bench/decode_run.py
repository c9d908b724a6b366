"""One timed greedy generation on kvos's engine, as the decode benchmarks time every system's."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvos.engine.engine import Engine


@dataclass
class Run:
    """One timed generation: perf_counter stamps and the generated ids."""

    start: float
    first: float
    last: float
    tokens: list[int]

    def prefill_tok_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / (self.first - self.start)

    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / (self.last - self.first)


def run_kvos(engine: Engine, prompt: list[int], new_tokens: int, eos: list[int]) -> Run:
    """Prefill then greedy decode in a fresh sequence; the sequence's blocks go back to the pool after."""
    seq = engine.new_sequence()
    try:
        start = time.perf_counter()
        token = greedy(engine.extend(seq, prompt)[0], eos)
        first = time.perf_counter()
        tokens = [token]
        for _ in range(new_tokens - 1):
            token = greedy(engine.decode(seq, token), eos)
            tokens.append(token)
        last = time.perf_counter()
    finally:
        engine.release(seq)
    return Run(start, first, last, tokens)


def greedy(logits: torch.Tensor, eos: list[int]) -> int:
    """argmax with the EOS ids masked, as transformers' min_new_tokens does."""
    if eos:
        logits[eos] = float("-inf")
    return int(logits.argmax())
