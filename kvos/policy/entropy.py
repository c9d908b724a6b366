"""Per-head attention entropy and the per-KV-head token budgets derived from it.

Calibration (``kvos calibrate``, :mod:`kvos.policy.calibration`) measures, for every layer and query head,
the Shannon entropy in bits of the attention distribution of a few queries per text, averaged; a KV head
takes the maximum over its query heads (the most demanding head that reads it). A head that spreads its
attention (high entropy) gets a larger share of the cache than one that looks at a few tokens:

    budget(layer, kv_head) = n * keep_ratio * clamp(H / mean H, 0.3, 2.5), rounded half up, clipped to [1, n]

where ``mean H`` is the mean over every (layer, KV head) of the map. That is the seed's rule (``seed``).
The ``inverse`` rule weighs each head by ``1 / max(H, 0.5 bits)`` instead, so a head that looks at a few
tokens gets the larger share: which few tokens it needs changes from query to query, where a head that
averages over many loses little when some are gone. On Qwen2.5-Coder-0.5B it loses half as much as
uniform budgets (docs/benchmarks.md), where the seed's rule loses more than they do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvos.errors import ConfigError

QUERY_FRACTIONS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
HEAD_TYPES: tuple[tuple[str, float], ...] = (
    ("sink", 0.5),
    ("focused", 1.5),
    ("moderate", 3.0),
    ("mixed", 4.0),
    ("diffuse", math.inf),
)
RATIO_CLAMP = (0.3, 2.5)
RULES = ("seed", "inverse")
INVERSE_FLOOR = 0.5  # bits: a "sink" head's entropy and below weigh as much as a sink head's
_KV_KEY = re.compile(r"^L(\d+)_K(\d+)$")

HeadMap = dict[tuple[int, int], float]


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of distributions along the last dim: ``[..., T]`` -> float64 ``[...]``
    (``0 log 0 = 0``; the rows are taken as given, not renormalised)."""
    return torch.special.entr(probs.double()).sum(dim=-1) / math.log(2.0)


def query_indices(num_tokens: int, fractions: Sequence[float] = QUERY_FRACTIONS) -> list[int]:
    """0-based indices of the query tokens at ``fractions`` of a sequence of ``num_tokens`` tokens:
    ``ceil(f * num_tokens) - 1`` (so 1.0 is the last token), at least 0, sorted and without repeats."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return sorted({max(0, math.ceil(f * num_tokens) - 1) for f in fractions})


def head_type(bits: float) -> str:
    """``sink`` (< 0.5 bits), ``focused`` (< 1.5), ``moderate`` (< 3.0), ``mixed`` (< 4.0) or ``diffuse``."""
    return next(name for name, upper in HEAD_TYPES if bits < upper)


def kv_head_entropies(head_entropies: Mapping[tuple[int, int], float], group: int) -> HeadMap:
    """(layer, kv_head) -> max entropy of its query heads; query head ``h`` reads KV head ``h // group``."""
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    out: HeadMap = {}
    for (layer, head), bits in head_entropies.items():
        key = (layer, head // group)
        out[key] = max(out.get(key, -math.inf), bits)
    return out


def head_budgets(
    kv_entropies: Mapping[tuple[int, int], float], n: int, keep_ratio: float
) -> dict[tuple[int, int], int]:
    """Tokens each (layer, kv_head) keeps out of ``n``: ``n * keep_ratio * clamp(H / mean H, 0.3, 2.5)``,
    rounded half up and clipped to ``[1, n]``. When every entropy is 0 the ratio is 1 for all heads."""
    if n < 1:
        raise ConfigError(f"n (tokens in context) must be >= 1, got {n}")
    if not 0 < keep_ratio <= 1:
        raise ConfigError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if not kv_entropies:
        return {}
    mean = sum(kv_entropies.values()) / len(kv_entropies)
    low, high = RATIO_CLAMP
    out = {}
    for key, bits in kv_entropies.items():
        ratio = min(max(bits / mean, low), high) if mean > 0 else 1.0
        out[key] = min(max(math.floor(n * keep_ratio * ratio + 0.5), 1), n)
    return out


def matched_budgets(
    kv_entropies: Mapping[tuple[int, int], float], n: int, keep_ratio: float, block_size: int = 1
) -> dict[tuple[int, int], int]:
    """:func:`head_budgets` at the memory of a uniform ``keep_ratio``: each budget rounded up to whole blocks
    of ``block_size`` tokens (a head's last block holds that many whatever its budget; at most ``n``), with
    the largest ratio whose blocks, summed over the heads, are no more than ``ceil(n * keep_ratio)`` tokens'
    worth per head would take. The seed's rule with the clamp's drift taken out: its budgets average to
    ``keep_ratio`` only when no head is clamped."""
    if not 0 < keep_ratio <= 1:
        raise ConfigError(f"keep_ratio must be in (0, 1], got {keep_ratio}")

    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    def whole(budgets: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
        return {row: min(blocks(b) * block_size, n) for row, b in budgets.items()}

    target = blocks(math.ceil(n * keep_ratio - 1e-9)) * len(kv_entropies)
    low, high = 0.0, 1.0  # the block total is nondecreasing in the ratio: bisect on it
    best = whole(head_budgets(kv_entropies, n, 1e-9))
    for _ in range(30):
        mid = (low + high) / 2
        trial = whole(head_budgets(kv_entropies, n, mid))
        if sum(blocks(b) for b in trial.values()) <= target:
            low, best = mid, trial
        else:
            high = mid
    return best


@dataclass(frozen=True)
class HeadBudgets:
    """A session's per-KV-head budgets: the calibrated entropies (``(layer, kv_head)`` -> bits) and the mean
    share ``keep`` of a chunk's tokens a head keeps (:func:`matched_budgets`)."""

    entropies: Mapping[tuple[int, int], float]
    keep: float
    rule: str = "seed"

    def __post_init__(self) -> None:
        if not 0 < self.keep <= 1:
            raise ConfigError(f"keep must be in (0, 1], got {self.keep}")
        if self.rule not in RULES:
            raise ConfigError(f"unknown budget rule {self.rule!r}; use one of {', '.join(RULES)}")

    def for_chunk(self, n: int, num_layers: int, num_kv_heads: int, block_size: int) -> list[int]:
        """Tokens each row (layer-major, ``layer * num_kv_heads + kv_head``) of an ``n``-token chunk keeps.
        ConfigError when the calibration does not cover the model's heads (it is another model's)."""
        rows = [(layer, head) for layer in range(num_layers) for head in range(num_kv_heads)]
        if set(rows) != set(self.entropies):
            raise ConfigError(
                f"the entropy calibration covers {len(self.entropies)} (layer, KV head) pairs, the model has "
                f"{num_layers} x {num_kv_heads}: it was measured on another model; run `kvos calibrate`"
            )
        budgets = matched_budgets(rule_weights(self.entropies, self.rule), n, self.keep, block_size)
        return [budgets[row] for row in rows]


def rule_weights(kv_entropies: Mapping[tuple[int, int], float], rule: str) -> HeadMap:
    """What :func:`head_budgets` shares the cache by: the entropies themselves (``seed``), or their inverses
    ``1 / max(H, INVERSE_FLOOR)`` (``inverse``)."""
    if rule == "seed":
        return dict(kv_entropies)
    if rule == "inverse":
        return {row: 1.0 / max(bits, INVERSE_FLOOR) for row, bits in kv_entropies.items()}
    raise ConfigError(f"unknown budget rule {rule!r}; use one of {', '.join(RULES)}")


def summarize(entropies: torch.Tensor, group: int) -> dict[str, Any]:
    """The JSON fields of a calibration from ``entropies``, float ``[num_layers, num_heads]`` bits per query
    head: ``entropy_stats`` (mean, population std, min, max over query heads), ``head_types`` (counts per
    type), ``head_entropies`` (``L{layer}_H{head}``) and ``kv_head_entropies`` (``L{layer}_K{kv_head}``)."""
    e = entropies.double()
    heads = {(layer, h): float(e[layer, h]) for layer in range(e.shape[0]) for h in range(e.shape[1])}
    counts = dict.fromkeys((name for name, _ in HEAD_TYPES), 0)
    for bits in heads.values():
        counts[head_type(bits)] += 1
    kv = kv_head_entropies(heads, group)
    return {
        "entropy_stats": {
            "mean": float(e.mean()),
            "std": float(e.std(correction=0)),
            "min": float(e.min()),
            "max": float(e.max()),
        },
        "head_types": counts,
        "head_entropies": {f"L{layer}_H{h}": bits for (layer, h), bits in heads.items()},
        "kv_head_entropies": {f"L{layer}_K{k}": bits for (layer, k), bits in kv.items()},
    }


def load_calibration(path: str | Path) -> HeadMap:
    """(layer, kv_head) -> entropy in bits, from the ``kv_head_entropies`` of a ``kvos calibrate`` JSON."""
    try:
        data = json.loads(Path(path).read_text())
        raw = data["kv_head_entropies"]
        out = {}
        for key, bits in raw.items():
            match = _KV_KEY.match(key)
            if match is None:
                raise ValueError(f"bad key {key!r}, expected L<layer>_K<kv_head>")
            out[int(match[1]), int(match[2])] = float(bits)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{path} is not a kvos calibration file ({e}); write one with `kvos calibrate`"
        ) from e
    return out
