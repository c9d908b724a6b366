"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded; logit bias, presence and
frequency penalties, an optional grammar mask; the log-probabilities of what was picked."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvos.engine.logit_stats import LogitStats
from kvos.errors import ConfigError
from kvos.model import decode_kernel

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
        self._bias: tuple[np.ndarray, np.ndarray, int] | None = None  # the bias's ids and values, and vocab
        # greedy with nothing but a bias to change the logits: the picks that need not read every logit
        self._plain_greedy = params.greedy and not (params.presence_penalty or params.frequency_penalty)
        # a bias that only lowers logits (the harnesses' "ban EOS"): the first largest, unbiased, stays first
        self._lowers_only = all(b <= 0.0 for b in params.logit_bias.values())

    def __call__(
        self, logits: torch.Tensor, allowed: torch.Tensor | None = None, stats: LogitStats | None = None
    ) -> int:
        """logits: float [vocab] (or [1, vocab]); allowed: bool [vocab] or None; ``stats``: the pass
        runner's :class:`LogitStats` of these logits, if any (a greedy pick then reads no logit, or only
        the biased ones) -> token id."""
        if stats is not None and allowed is None:
            token = self._greedy_from_stats(logits, stats)
            if token is not None:
                return token
        logits = logits.reshape(-1).float()
        if self._biased_argmax_applies(logits, allowed):
            return self._biased_argmax(logits.detach().numpy())
        if self.params.adjusts_logits:
            logits = self.adjust(logits)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        # the picks are in numpy: a torch operator costs several microseconds of dispatch, a numpy one
        # about one, and torch's CPU argmax scans 151,936 logits in 0.27 ms where numpy takes 0.01
        values = logits.detach().cpu().numpy()
        if self.params.greedy:
            token = int(values.argmax())  # the first largest (a NaN counts as the largest, as in torch)
        else:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                scaled = values / np.float32(self.params.temperature)
                peak = scaled.max()  # NaN with any NaN, +inf with any +inf, -inf when all are
            if not np.isfinite(peak):
                # a temperature so small that the logits overflowed: the limit of sampling is argmax
                token = int(values.argmax())
            elif self.params.top_k > 0 or self.params.top_p < 1.0:
                ids, probs = _support(scaled, self.params.top_k, self.params.top_p)
                index = draw(probs, self.generator)
                token = index if ids is None else int(ids[index])
            else:  # softmax's weights before normalising, which a draw does not need
                token = draw(np.exp(np.subtract(scaled, peak, out=scaled), out=scaled), self.generator)
        if self.params.presence_penalty or self.params.frequency_penalty:
            self._count(token, logits.shape[0])
        return token

    def _greedy_from_stats(self, logits: torch.Tensor, stats: LogitStats) -> int | None:
        """The greedy pick from the row's largest logit and the biased logits alone (no logit at all when
        the bias only lowers tokens other than the largest's), exactly as the argmax of the biased row (the
        first of equal largest values); None where the stats do not settle it (sampling, penalties, or the
        largest logit's token biased)."""
        if not self._plain_greedy:
            return None
        if not self.params.logit_bias or (self._lowers_only and stats.best not in self.params.logit_bias):
            return stats.best
        values = logits.detach().reshape(-1)
        if values.dtype != torch.float32 or values.device.type != "cpu":
            return None
        ids, biases = self._bias_arrays(values.shape[0])
        if ids.size == 0:
            return stats.best
        if stats.best in self.params.logit_bias:
            return None  # the largest logit is biased: the second largest is not known here
        biased = values.numpy()[ids] + biases
        peak = float(biased.max())
        if not math.isfinite(peak) or peak < stats.top:
            return stats.best if math.isfinite(peak) else None
        first = int(ids[biased == np.float32(peak)].min())
        return min(first, stats.best) if peak == stats.top else first

    def _bias_arrays(self, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """The logit bias's token ids within ``vocab`` (int64) and their biases (float32), cached."""
        if self._bias is None or self._bias[2] != vocab:
            pairs = [(t, b) for t, b in self.params.logit_bias.items() if 0 <= t < vocab]
            ids = np.fromiter((t for t, _ in pairs), dtype=np.int64, count=len(pairs))
            self._bias = (ids, np.fromiter((b for _, b in pairs), dtype=np.float32, count=len(pairs)), vocab)
        return self._bias[0], self._bias[1]

    def _biased_argmax_applies(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> bool:
        """Greedy with a logit bias and nothing else to change the logits (the common "ban EOS" request),
        on float32 logits of the CPU."""
        return (
            self._plain_greedy
            and bool(self.params.logit_bias)
            and allowed is None
            and logits.dtype == torch.float32
            and logits.device.type == "cpu"
            and logits.is_contiguous()
        )

    def _biased_argmax(self, values: np.ndarray) -> int:
        """The argmax of ``values`` (float32 [vocab]) with the logit bias added, as :meth:`adjust` then
        argmax would pick, without copying the vocabulary: the biased entries are set in place for the
        argmax and put back (``values`` is this session's logits; nothing else reads them meanwhile)."""
        ids, biases = self._bias_arrays(values.shape[0])
        saved = values[ids]
        try:
            values[ids] = saved + biases
            return int(values.argmax())
        finally:
            values[ids] = saved

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """OpenAI's ``mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty`` (c[j]: how often
        token j was generated so far), plus ``logit_bias``. logits: float [vocab] -> float32 [vocab] on the
        CPU. In numpy, every bias in one indexed add (a torch index per bias cost ~5 us a token: a harness
        that bans EOS sends two or three), in float32 as torch added them."""
        p = self.params
        out = logits.detach().reshape(-1).float().cpu().numpy().copy()
        if p.logit_bias:
            pairs = [(t, b) for t, b in p.logit_bias.items() if 0 <= t < out.shape[0]]
            ids = np.fromiter((t for t, _ in pairs), dtype=np.int64, count=len(pairs))
            out[ids] += np.fromiter((b for _, b in pairs), dtype=np.float32, count=len(pairs))
        if self.counts is not None:
            counts = self.counts.numpy()
            out -= counts * np.float32(p.frequency_penalty) + (counts > 0) * np.float32(p.presence_penalty)
        return torch.from_numpy(out)

    def _count(self, token: int, vocab: int) -> None:
        if self.counts is None:
            self.counts = torch.zeros(vocab)
        self.counts[token] += 1


def log_normaliser(values: torch.Tensor) -> float:
    """log sum exp of float32 logits [vocab] (contiguous, CPU): the decode kernel's ``log_normaliser``
    (an AVX2 maximum, then AVX-512 or AVX2 exponentials summed in float32 eight terms a lane, those sums
    in float64: 49,152 logits in 8.5 us where numpy took 30-38, 151,936 in 25 against 91-105, AMD Zen 5)
    where it is built and the logits are finite; else numpy's, in float64 too."""
    built = decode_kernel.kernel()
    if built is not None:
        found = float(built.log_normaliser(values))
        if math.isfinite(found):
            return found
    array = values.numpy()
    peak = float(array.max())
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(np.exp(array - np.float32(peak)).sum(dtype=np.float64))
    return peak + math.log(total)


def token_logprob(
    logits: torch.Tensor,
    token: int,
    top: int,
    spell: Callable[[int], bytes] | None = None,
    stats: LogitStats | None = None,
) -> TokenLogprob:
    """The model's log-softmax at ``token`` and at its ``top`` most likely tokens, spelled by ``spell``
    (token id -> bytes). logits: float [vocab]; ``stats``: the pass runner's :class:`LogitStats` of them,
    whose normaliser then needs no pass over the logits. In numpy, as the sampler (it runs for every token
    of a request that asks for log-probabilities): the log of the normaliser summed in float64."""
    flat = logits.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.float().cpu().contiguous()  # a pass's logits are all three already: no call per token
    values = flat.numpy()
    normaliser = log_normaliser(flat) if stats is None else stats.normaliser

    def scored(token_id: int) -> Scored:
        value = float(values[token_id]) - normaliser
        return Scored(token_id, value, spell(token_id) if spell is not None else b"")

    best: list[int] = []
    if top > 0:
        count = min(top, values.shape[0])
        ids = np.argpartition(values, values.shape[0] - count)[values.shape[0] - count :]
        best = ids[np.argsort(-values[ids], kind="stable")].tolist()
    return TokenLogprob(scored(token), [scored(t) for t in best])


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of logits float32 [vocab] kept to the top-k tokens and the smallest nucleus holding top_p
    mass (at least the most likely token, however small top_p is)."""
    values = logits.detach().cpu().numpy()
    ids, probs = _support(values, top_k, top_p)
    if ids is None:
        return torch.from_numpy(probs)
    dense = np.zeros(values.shape[0], dtype=np.float32)
    dense[ids] = probs
    return torch.from_numpy(dense)


def _support(logits: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray | None, np.ndarray]:
    """:func:`filtered_probs` without its zeros: the token ids kept, ascending (None: every token), and
    their probabilities, float32. The softmax and the nucleus run over the top-k tokens alone when top_k is
    set (a partition finds them, ties at the k-th value kept); a draw then reads only what was kept."""
    vocab = logits.shape[0]
    ids = None
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k)[vocab - top_k]  # the k-th largest
        ids = np.flatnonzero(logits >= kth)
        logits = logits[ids]
    weights = np.exp(logits - logits.max())
    probs = weights / np.float32(weights.sum(dtype=np.float64))
    if top_p < 1.0:
        kept, probs = _nucleus(probs, top_p)
        ids = kept if ids is None else ids[kept]
    return ids, probs


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely entries of ``probs`` float32 [n] whose mass reaches ``top_p``: their
    indices, ascending, and their probabilities renormalised. Sorting all 151,936 tokens costs ~12 ms; the
    nucleus is a prefix of that order, and the tokens under ``(1 - top_p) / n`` hold less than 1 - top_p
    together, so it lies among the tokens at or above that floor: only they are sorted (all of them where
    rounding left their mass short of top_p)."""
    floor = (1.0 - top_p) / probs.shape[0]
    for candidates in (np.flatnonzero(probs >= floor), np.arange(probs.shape[0])):
        order = candidates[np.argsort(-probs[candidates], kind="stable")]
        values = probs[order].astype(np.float64)
        total = np.cumsum(values)
        if total[-1] >= top_p:
            break
    drop = total - values >= top_p  # the mass before each token already reaches top_p
    drop[0] = False  # a top_p below float32's smallest value rounds to 0, which would drop them all
    kept = np.sort(order[~drop])
    mass = probs[kept].astype(np.float64)
    return kept, (mass / mass.sum()).astype(np.float32)


_DRAW_BLOCK = 1024  # tokens a block of the two-level cumulative distribution


def draw(weights: np.ndarray, generator: torch.Generator) -> int:
    """One token drawn with probability proportional to ``weights`` float32 [vocab] (non-negative, not
    necessarily normalised): the first token whose cumulative weight passes ``u x total`` for one uniform
    ``u`` from ``generator`` (inverse-CDF sampling), so a token of zero weight is never chosen. In two
    levels, in float64: the blocks' sums accumulated, then the cumulative sum inside the block the draw
    lands in. ``torch.multinomial`` draws an exponential per token: 3.5 ms at 151,936 tokens, this 0.1."""
    flat = weights.reshape(-1)
    vocab = flat.shape[0]
    whole = vocab - vocab % _DRAW_BLOCK
    sums = flat[:whole].reshape(-1, _DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    if whole < vocab:
        sums = np.append(sums, flat[whole:].sum(dtype=np.float64))
    blocks = np.cumsum(sums)
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * float(blocks[-1])
    block = _first_above(blocks, u, sums)
    start = block * _DRAW_BLOCK
    inside = flat[start : start + _DRAW_BLOCK]
    below = float(blocks[block - 1]) if block > 0 else 0.0
    return start + _first_above(np.cumsum(inside, dtype=np.float64), u - below, inside)


def _first_above(cdf: np.ndarray, u: float, mass: np.ndarray) -> int:
    """The first index whose ``cdf`` [n] (float64, non-decreasing) is above ``u``; where rounding left
    ``u`` at or past the last value, the last index with ``mass`` [n] above zero."""
    index = int(np.searchsorted(cdf, u, side="right"))
    if index < cdf.shape[0]:
        return index
    return int(np.flatnonzero(mass > 0)[-1])
