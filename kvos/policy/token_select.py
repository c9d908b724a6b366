"""Token-level selection policies for per-head KV budgets, one interface for kvos and the baselines.

Each policy sees one (layer, KV head) at a time (:class:`HeadState`) and returns the row indices to keep.
The base class does the common part: the first ``sink_count`` positions (attention sinks) are always kept,
a policy may protect more (a recent window, an earlier choice), and the rest of the budget goes to the
highest :meth:`TokenPolicy.score`. :mod:`kvos.policy.budgeted` runs them on the engine's own sequences.
Names (:data:`POLICIES`):

- ``uniform``: every KV head the same budget; half of the non-sink budget to the most recent tokens (one
  just written has had few queries to attend to it), half by importance = mean attention a token received
  per query that could see it (max over the KV head's query heads), so old tokens are not favoured by age.
- ``entropy``: the same importance, per-head budgets ``head_budgets(calibration, n, budget / n)``.
- ``streaming_llm`` (Xiao et al. 2023): sinks + the most recent tokens.
- ``h2o`` (Zhang et al. 2023): half of the non-sink budget to the most recent tokens, half to the heavy
  hitters by cumulative attention (summed over every query so far).
- ``snapkv`` (Li et al. 2024): at the first eviction (the end of the prefill when the prompt exceeds the
  budget) the mean attention of the last 32 queries, max-pooled over neighbouring keys (kernel 7), picks the
  prefix tokens; the most recent ``min(32, half the non-sink budget)`` tokens are kept as well. The choice
  is fixed from then on; later evictions keep it plus the most recent tokens.
- ``random``: uniformly random non-sink tokens (seeded): the control.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvos.errors import ConfigError
from kvos.policy.entropy import head_budgets, matched_budgets

DEFAULT_SINKS = 4
Row = tuple[int, int]  # (layer, kv_head)


@dataclass
class HeadState:
    """What a token policy sees of one (layer, KV head) when it must choose which tokens to keep.

    positions: int64 [T] original positions of the held tokens (increasing, row order).
    cumulative: float32 [T] attention each token received, summed over every query so far (H2O), max over
        the KV head's query heads.
    mean_attention: float32 [T] the same per query head divided by how many queries could see the token
        (``next_position - position``), then the max over query heads: attention without the age bias.
    window: float32 [T] mean attention of the last <= 32 queries (SnapKV's observation window), max over
        query heads; None when not recorded (after the first eviction, or window 0).
    next_position: position of the next token (= tokens seen so far).
    """

    layer: int
    kv_head: int
    positions: torch.Tensor
    cumulative: torch.Tensor
    mean_attention: torch.Tensor
    window: torch.Tensor | None
    next_position: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class TokenPolicy:
    """Keeps sinks and :meth:`protected` tokens, then the top :meth:`score` tokens up to the budget."""

    name: ClassVar[str] = ""
    sink_count: int = DEFAULT_SINKS

    def __post_init__(self) -> None:
        if self.sink_count < 0:
            raise ConfigError(f"{type(self).__name__}.sink_count must be >= 0, got {self.sink_count}")

    def budgets(self, n_seen: int, budget_tokens: int, rows: Sequence[Row]) -> dict[Row, int]:
        """Every row may hold ``budget_tokens`` (a uniform budget)."""
        return dict.fromkeys(rows, budget_tokens)

    def score(self, state: HeadState) -> torch.Tensor:
        """float [T]: higher is kept first."""
        raise NotImplementedError

    def protected(self, state: HeadState, budget: int) -> torch.Tensor:
        """bool [T]: tokens kept before any scoring, besides the sinks (none by default)."""
        return torch.zeros(state.num_tokens, dtype=torch.bool)

    def select(self, state: HeadState, budget: int) -> torch.Tensor:
        """Row indices to keep: int64 [min(budget, T)], increasing."""
        t = state.num_tokens
        if t <= budget:
            return torch.arange(t)
        sinks = state.positions < self.sink_count
        sinks &= torch.cumsum(sinks, 0) <= budget  # a budget below the sink count keeps the first sinks
        keep = sinks | (self.protected(state, budget - int(sinks.sum())) & ~sinks)
        free = budget - int(keep.sum())
        if free < 0:
            raise ConfigError(f"{self.name}: {int(keep.sum())} protected tokens exceed the budget {budget}")
        if free > 0:
            scores = self.score(state).float().masked_fill(keep, float("-inf"))
            keep[torch.topk(scores, free).indices] = True
        return keep.nonzero().flatten()


def recent(state: HeadState, count: int) -> torch.Tensor:
    """bool [T]: the ``count`` most recent tokens of the row."""
    mask = torch.zeros(state.num_tokens, dtype=torch.bool)
    if count > 0:
        mask[-count:] = True
    return mask


@dataclass
class Uniform(TokenPolicy):
    """Same budget for every KV head; half of the non-sink budget to the most recent tokens, the other half to
    the highest mean attention received (H2O's split, with mean attention for its cumulative sums)."""

    name: ClassVar[str] = "uniform"

    def protected(self, state: HeadState, budget: int) -> torch.Tensor:
        return recent(state, budget - budget // 2)  # as H2O: a token just written has had few queries

    def score(self, state: HeadState) -> torch.Tensor:
        return state.mean_attention


@dataclass
class Entropy(Uniform):
    """Per-head budgets from calibrated attention entropy (``kvos calibrate``); same importance as
    :class:`Uniform`. ``calibration``: (layer, kv_head) -> entropy in bits, covering every row."""

    name: ClassVar[str] = "entropy"
    calibration: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def budgets(self, n_seen: int, budget_tokens: int, rows: Sequence[Row]) -> dict[Row, int]:
        missing = [row for row in rows if row not in self.calibration]
        if missing:
            raise ConfigError(
                f"the calibration has no entropy for (layer, kv_head) {missing[:4]}; recalibrate"
            )
        if budget_tokens >= n_seen:
            return dict.fromkeys(rows, n_seen)
        entropies = {row: self.calibration[row] for row in rows}
        return head_budgets(entropies, n_seen, budget_tokens / n_seen)


@dataclass
class EntropyMatched(Entropy):
    """:class:`Entropy` at the uniform policy's memory: ``keep_ratio`` is the largest for which the heads'
    budgets, each rounded up to whole blocks of ``block_size`` tokens (a head's last block holds that many
    whatever its budget), take no more blocks than ``budget_tokens`` per row would."""

    name: ClassVar[str] = "entropy_matched"
    block_size: int = 1

    def budgets(self, n_seen: int, budget_tokens: int, rows: Sequence[Row]) -> dict[Row, int]:
        if budget_tokens >= n_seen:
            return dict.fromkeys(rows, n_seen)
        entropies = {row: self.calibration[row] for row in rows}
        return matched_budgets(entropies, n_seen, budget_tokens / n_seen, self.block_size)


@dataclass
class StreamingLLM(TokenPolicy):
    """Attention sinks plus the most recent tokens."""

    name: ClassVar[str] = "streaming_llm"

    def score(self, state: HeadState) -> torch.Tensor:
        return state.positions.float()


@dataclass
class H2O(TokenPolicy):
    """Heavy hitters (cumulative attention) and a recent window, half of the non-sink budget each (the
    recent half gets the odd token)."""

    name: ClassVar[str] = "h2o"

    def protected(self, state: HeadState, budget: int) -> torch.Tensor:
        return recent(state, budget - budget // 2)

    def score(self, state: HeadState) -> torch.Tensor:
        return state.cumulative


@dataclass
class SnapKV(TokenPolicy):
    """Observation-window selection, decided once per head at its first eviction (see module docstring)."""

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7
    _chosen: dict[Row, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"SnapKV needs window >= 1 and an odd kernel, got {self.window}, {self.kernel}")

    def select(self, state: HeadState, budget: int) -> torch.Tensor:
        row = (state.layer, state.kv_head)
        first = row not in self._chosen and state.num_tokens > budget
        keep = super().select(state, budget)
        if first:  # the choice made now: everything kept except the recent window
            r = self._recent_count(budget - int((state.positions < self.sink_count).sum()))
            self._chosen[row] = state.positions[keep[: max(len(keep) - r, 0)]]
        return keep

    def _recent_count(self, budget: int) -> int:
        return min(self.window, budget // 2)

    def protected(self, state: HeadState, budget: int) -> torch.Tensor:
        chosen = self._chosen.get((state.layer, state.kv_head))
        if chosen is None:
            return recent(state, self._recent_count(budget))
        return torch.isin(state.positions, chosen)

    def score(self, state: HeadState) -> torch.Tensor:
        if (state.layer, state.kv_head) in self._chosen:
            return state.positions.float()  # after the choice: the most recent tokens fill the rest
        if state.window is None:
            raise ConfigError("snapkv needs the observation-window attention at its first eviction")
        return pool_scores(state.window, self.kernel)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max-pool of per-token scores [T] (stride 1, same length), as SnapKV clusters its selection."""
    return F.max_pool1d(scores.float()[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]


def observed_keep(
    probs: Sequence[torch.Tensor], budgets: Sequence[int], num_kv_heads: int, sinks: int, kernel: int = 7
) -> list[list[int]]:
    """Which of ``n`` tokens each (layer, KV head) keeps, chosen once from an observation window's attention
    (SnapKV's rule with per-head budgets): ``probs[layer]`` float [num_heads, n], the window's mean
    attention of each query head over the tokens; a KV head scores a token by the sum over its query heads
    (head ``h`` reads KV head ``h // group``), max-pooled over ``kernel`` neighbours, and keeps the first
    ``sinks`` tokens and its ``budgets[row]`` best (rows layer-major). Returns increasing indices per row."""
    out = []
    for layer, p in enumerate(probs):
        n = p.shape[-1]
        grouped = p.float().cpu().reshape(num_kv_heads, -1, n).sum(dim=1)  # [Hkv, n]
        for head in range(num_kv_heads):
            scores = pool_scores(grouped[head], kernel)
            scores[:sinks] = float("inf")
            budget = min(budgets[layer * num_kv_heads + head], n)
            out.append(sorted(torch.topk(scores, budget).indices.tolist()))
    return out


@dataclass
class Random(TokenPolicy):
    """Uniformly random non-sink tokens from a seeded generator (the control)."""

    name: ClassVar[str] = "random"
    seed: int = 0
    _gen: torch.Generator = field(default_factory=torch.Generator, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._gen.manual_seed(self.seed)

    def score(self, state: HeadState) -> torch.Tensor:
        return torch.rand(state.num_tokens, generator=self._gen)


POLICIES: dict[str, type[TokenPolicy]] = {
    cls.name: cls for cls in (Uniform, Entropy, EntropyMatched, StreamingLLM, H2O, SnapKV, Random)
}


def make_policy(
    name: str,
    *,
    sink_count: int = DEFAULT_SINKS,
    calibration: Mapping[tuple[int, int], float] | None = None,
    seed: int = 0,
    block_size: int = 1,
) -> TokenPolicy:
    """A fresh policy by name (``entropy`` needs ``calibration``; ``random`` uses ``seed``)."""
    if name in ("entropy", "entropy_matched"):
        if not calibration:
            raise ConfigError(f"the {name} policy needs a calibration: run `kvos calibrate` and load it")
        if name == "entropy":
            return Entropy(sink_count=sink_count, calibration=dict(calibration))
        return EntropyMatched(sink_count=sink_count, calibration=dict(calibration), block_size=block_size)
    if name == "random":
        return Random(sink_count=sink_count, seed=seed)
    if name not in POLICIES:
        raise ConfigError(f"unknown token policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](sink_count=sink_count)
