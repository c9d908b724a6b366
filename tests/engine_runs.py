"""A fixed run of engine steps that every kind of forward pass takes part in, for tests comparing two paths
through the model (a kernel against the eager ops, the decode plan against the generic layer loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvos.engine.engine import Engine
from kvos.engine.sequence import Sequence
from kvos.model.loader import load_model
from kvos.model.transformer import Transformer

Outputs = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
STEPS = 3 + 6 * 3 + 3 + 1 + 1  # the logits mixed_run returns


def three_prefilled(model: Transformer, **options: Any) -> tuple[Engine, list[Sequence], list[torch.Tensor]]:
    """An engine on ``model`` (blocks of 4 tokens; ``options`` to :class:`Engine`) with three sequences of
    30, 7 and 19 random tokens prefilled in one step: (the engine, the sequences, the step's logits)."""
    engine = Engine(model, block_size=4, **options)
    seqs = [engine.new_sequence() for _ in range(3)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (30, 7, 19)]
    return engine, seqs, list(engine.step(list(zip(seqs, prompts, strict=True))))


def mixed_run(path: Path) -> Outputs:
    """Prefills of 30, 7 and 19 tokens; six batched decode steps; a prefill of 5 tokens beside two decode
    steps; one decode step with attention captured at every layer and one with queries recorded at every
    layer: (every step's logits, the captured probabilities by layer, the recorded queries by layer)."""
    model = load_model(path)
    engine, seqs, logits = three_prefilled(model)
    vocab = model.config.vocab_size
    for i in range(6):
        logits += engine.step([(s, [(i * 7 + j) % vocab]) for j, s in enumerate(seqs)])
    logits += engine.step([(seqs[0], [1, 2, 3, 4, 5]), (seqs[1], [6]), (seqs[2], [7])])
    layers = frozenset(range(model.config.num_layers))
    captured: dict[int, torch.Tensor] = {}
    logits.append(engine.extend(seqs[1], [4], capture_layers=layers, captured=captured))
    queries: dict[int, torch.Tensor] = {}
    logits.append(engine.extend(seqs[2], [9], query_layers=layers, queries=queries))
    assert len(logits) == STEPS and len(captured) == len(queries) == len(layers)
    return logits, [captured[i] for i in sorted(captured)], [queries[i] for i in sorted(queries)]
