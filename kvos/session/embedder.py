"""Embeddings of token runs, for task focus and similarity recovery.

Both embedders are context-free: a chunk and a query are embedded the same way whatever surrounds them,
so their cosines are comparable, and a new user message can be embedded before it is decoded (similarity
recovery restores chunks before the new tail goes through the model).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from kvos.engine.engine import Engine
from kvos.errors import ConfigError

EmbedderName = Literal["hidden", "tokens"]
EMBEDDERS: tuple[EmbedderName, ...] = ("hidden", "tokens")
# The default: the token embedder, which costs no forward pass. The hidden-state one ran a forward pass over
# each chunk's last 256 tokens the first time it was scored and over every user message: on SmolLM2-135M
# behind `kvos serve`, 22 of the 25 s of the turn that first evicted and ~0.6 s of every ~3 s turn, for
# the same recall on the built-in model (99% / 100% at 25% / 50%; docs/benchmarks.md).
DEFAULT_EMBEDDER: EmbedderName = "tokens"
EMBEDDER_HELP = (
    "how chunks and user messages are embedded for task focus: tokens (the default: their input embedding "
    "rows, no forward pass) or hidden (the model's final hidden states: a forward pass per chunk and message)"
)


def add_embedder_argument(p: argparse.ArgumentParser, help_text: str = EMBEDDER_HELP) -> None:
    """The ``--embedder`` option of every command that plays sessions (default :data:`DEFAULT_EMBEDDER`)."""
    p.add_argument("--embedder", choices=EMBEDDERS, default=DEFAULT_EMBEDDER, help=help_text)


class Embedder(Protocol):
    def __call__(self, token_ids: Sequence[int]) -> torch.Tensor:
        """token ids -> L2-normalised float32 [dim]."""
        ...


class HiddenStateEmbedder:
    """Mean of the model's final hidden states over the run (at most its last ``max_tokens`` tokens),
    from a standalone forward pass that leaves the KV pool untouched."""

    def __init__(self, engine: Engine, max_tokens: int = 256) -> None:
        self.engine, self.max_tokens = engine, max_tokens

    def __call__(self, token_ids: Sequence[int]) -> torch.Tensor:
        hidden = self.engine.hidden_states(list(token_ids)[-self.max_tokens :])
        return F.normalize(hidden.float().mean(0), dim=0).cpu()


class TokenEmbedder:
    """Mean of the input embedding rows of the run's tokens: lexical, and free (no forward pass)."""

    def __init__(self, engine: Engine) -> None:
        self.table = engine.model.embed

    def __call__(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.table.device)
        return F.normalize(self.table.index_select(0, ids).float().mean(0), dim=0).cpu()


def make_embedder(name: EmbedderName, engine: Engine) -> Embedder:
    """The embedder called ``name`` (:data:`EMBEDDERS`) over ``engine``'s model."""
    if name == "hidden":
        return HiddenStateEmbedder(engine)
    if name == "tokens":
        return TokenEmbedder(engine)
    raise ConfigError(f"embedder must be 'hidden' or 'tokens', got {name!r}")
