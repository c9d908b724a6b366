"""A fixed run of engine steps that every kind of forward pass takes part in, for tests comparing two paths
through the model (a kernel against the eager ops, the decode plan against the generic layer loop)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvos.engine.engine import Engine
from kvos.model.loader import load_model

Outputs = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
STEPS = 3 + 6 * 3 + 3 + 1 + 1  # the logits mixed_run returns


def mixed_run(path: Path) -> Outputs:
    """Prefills of 30, 7 and 19 tokens; six batched decode steps; a prefill of 5 tokens beside two decode
    steps; one decode step with attention captured at every layer and one with queries recorded at every
    layer: (every step's logits, the captured probabilities by layer, the recorded queries by layer)."""
    model = load_model(path)
    engine = Engine(model, block_size=4)
    seqs = [engine.new_sequence() for _ in range(3)]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (30, 7, 19)]
    logits = list(engine.step(list(zip(seqs, prompts, strict=True))))
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
