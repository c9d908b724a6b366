"""A mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE): a router picks ``top_k`` of the layer's experts for
each row, and the row's output is the chosen experts' SwiGLU outputs weighted by the router's probabilities
(plus, in Qwen3.5-MoE, a shared expert every row goes through, scaled by a gate of its own).

The router is a dense [experts, hidden] matrix; its logits go through a float32 softmax, the ``top_k`` largest
probabilities are kept (renormalised to sum to one where the model says so) and cast back to the rows'
dtype, as transformers computes them. Each expert then runs once over the rows routed to it, in expert order,
its weighted output added into those rows: one gate/up product and one down product per expert that got
rows, so a step's rows share each expert's weights whichever sequences they come from (a decode step of
eight sequences reads each chosen expert once). The experts' weights are plain or quantized
(:mod:`kvos.model.linear`): from a GGUF file they stay in the file's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvos.model.linear import Weight, matmul


@dataclass
class Experts:
    """One layer's experts: ``router`` [experts, hidden] (dense), each expert's fused ``gate_up``
    [2 * inter, hidden] (the gate, then the up projection) and ``down`` [hidden, inter]."""

    router: torch.Tensor
    gate_up: Sequence[Weight]
    down: Sequence[Weight]
    top_k: int
    renormalise: bool
    shared: SharedExpert | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, hidden] -> (weights [n, top_k] in h's dtype, expert ids int64 [n, top_k])."""
        probs = torch.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def __call__(self, h: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [n, hidden] (the normed rows) -> the mixture's output [n, hidden]; ``gate`` is the model's gated
        activation ([n, 2 * inter] -> [n, inter])."""
        weights, ids = self.route(h)
        out = torch.zeros_like(h)
        for expert in torch.unique(ids).tolist():  # ascending, as transformers visits them
            rows, slot = torch.where(ids == expert)
            y = matmul(gate(matmul(h[rows], self.gate_up[expert])), self.down[expert])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out if self.shared is None else out + self.shared(h, gate)


@dataclass
class SharedExpert:
    """An expert every row goes through (Qwen3.5-MoE), scaled per row by ``sigmoid(h . gate)``: ``gate_up``
    [2 * inter, hidden], ``down`` [hidden, inter], ``gate`` [1, hidden] (dense)."""

    gate_up: Weight
    down: Weight
    gate: torch.Tensor

    def __call__(self, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [n, hidden] -> [n, hidden]."""
        return torch.sigmoid(F.linear(h, self.gate)) * matmul(act(matmul(h, self.gate_up)), self.down)
