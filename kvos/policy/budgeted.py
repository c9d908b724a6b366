"""Streaming a text under a per-head token budget: a per-head sequence driven by a token policy.

Teacher-forced, so the logits of every position can be compared with a full cache's; used by
``kvos bench quality`` for the budget policies (uniform, entropy and the baselines).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvos.engine.engine import Engine
from kvos.engine.head_sequence import HeadSequence
from kvos.errors import ConfigError
from kvos.model.transformer import Transformer
from kvos.policy.token_select import make_policy


@dataclass
class BudgetedRun:
    """Result of :func:`run_budgeted`.

    logits: float32 [n_tokens - 1, vocab]: row i predicts token i + 1 from tokens[: i + 1].
    resident_bytes: mean over steps of the K/V bytes the sequence holds in the pool's head store (its
        head-blocks x bytes per head-block), measured after each step's eviction.
    uniform_bytes: the same mean for a uniform split of the same total tokens over every (layer, KV head).
    seconds: wall time of the run.
    """

    logits: torch.Tensor
    resident_bytes: float
    uniform_bytes: float
    seconds: float


def run_budgeted(
    model: Transformer,
    token_ids: list[int],
    policy: str,
    budget_tokens: int,
    *,
    calibration: dict[tuple[int, int], float] | None = None,
    prefill: int = 0,
    sink_count: int = 4,
    block_size: int = 16,
    seed: int = 0,
) -> BudgetedRun:
    """Teacher-forced streaming of ``token_ids`` under a per-head token budget, one policy of
    :data:`kvos.policy.token_select.POLICIES`.

    The first ``prefill`` tokens go in one forward pass, the rest one at a time. After every step each
    (layer, KV head) holding more than its budget drops down to it, as the policy chooses: ``budget_tokens``
    per head, or for ``entropy`` the :func:`~kvos.policy.entropy.head_budgets` of ``calibration`` with
    ``keep_ratio = budget_tokens / n`` (n = tokens seen). Keys keep their original positions, so keep
    ``token_ids`` within the model's native context.
    """
    if len(token_ids) < 2:
        raise ConfigError(f"run_budgeted needs at least 2 tokens, got {len(token_ids)}")
    if budget_tokens < 1:
        raise ConfigError(f"budget_tokens must be >= 1, got {budget_tokens}")
    chooser = make_policy(
        policy, sink_count=sink_count, calibration=calibration, seed=seed, block_size=block_size
    )
    start = time.perf_counter()
    cache = HeadSequence(Engine(model, block_size))
    ids = token_ids[:-1]  # the last token is only ever predicted
    first = min(max(prefill, 1), len(ids))
    outputs, resident, uniform = [], [], []
    for step in [ids[:first]] + [[t] for t in ids[first:]]:
        outputs.append(cache.extend(step))
        cache.enforce(chooser, chooser.budgets(cache.next_position, budget_tokens, cache.rows))
        resident.append(cache.resident_bytes)
        uniform.append(cache.uniform_bytes())
    return BudgetedRun(
        logits=torch.cat(outputs).float(),
        resident_bytes=math.fsum(resident) / len(resident),
        uniform_bytes=math.fsum(uniform) / len(uniform),
        seconds=time.perf_counter() - start,
    )
