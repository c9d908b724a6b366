"""Teacher-forced runs on the kvos engine for ``kvos bench quality``: the full cache, magnitude
sparsification (:class:`~kvos.policy.sparsify.MagnitudeSparsifier`) and its random-zeroing ablation, plus
the metrics that compare a run's logits with the full cache's.

A run prefills the first ``prefill`` tokens of a window, then feeds the rest one token at a time (the
token that really comes next, not a sampled one), and keeps the logits of every position: row ``i``
predicts token ``i + 1`` from tokens ``[: i + 1]``. After every step a :class:`CacheHook` may rewrite the
sequence's cached K/V in the pool, as a serving engine would between decode steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvos.engine.engine import Engine
from kvos.engine.sequence import Sequence as KVSequence
from kvos.memory.codec import encode
from kvos.memory.pool import KVPool
from kvos.policy.sparsify import MagnitudeSparsifier, WindowSealer

Pass = tuple[int, torch.Tensor]  # (tokens in the sequence, zero counts int64 [L, Hkv, 2]) after a pass


class CacheHook(Protocol):
    """Called after every forward step of a run, with the sequence's tokens all in the pool."""

    def after_step(self, pool: KVPool, seq: KVSequence) -> None: ...


def zero_counts(pool: KVPool, slots: torch.Tensor, positions: torch.Tensor, n_sink: int) -> torch.Tensor:
    """Exact zeros (``== 0``, so +0.0 and -0.0) among the K and V elements of the tokens at positions
    ``>= n_sink``: int64 ``[num_layers, num_kv_heads, 2]`` (last axis: K, V)."""
    chosen = slots[positions >= n_sink]
    rows = []
    for layer in range(pool.layout.num_layers):
        k, v = pool.gather(layer, chosen)  # [T, Hkv, D]
        rows.append(torch.stack([(k == 0).sum(dim=(0, 2)), (v == 0).sum(dim=(0, 2))], dim=-1))
    return torch.stack(rows).to(torch.int64).cpu()


@dataclass
class NoHook:
    """The full cache: leaves the K/V as the model wrote them."""

    def after_step(self, pool: KVPool, seq: KVSequence) -> None:
        return None


@dataclass
class SparsifyHook:
    """Runs a :class:`MagnitudeSparsifier` on its schedule and records, per pass, the sequence's token
    count and the zero counts per (layer, KV head, K/V) over the non-sink positions right after it.

    With ``chunk``, the schedule is the sessions' (:mod:`kvos.session.compressor`): every ``chunk`` new
    tokens are thresholded once, by their own statistics, and never again."""

    sparsifier: MagnitudeSparsifier
    chunk: int | None = None
    passes: list[Pass] = field(default_factory=list)
    _sealer: WindowSealer | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.chunk is not None:
            self._sealer = WindowSealer(self.sparsifier, self.chunk)

    def after_step(self, pool: KVPool, seq: KVSequence) -> None:
        s, n = self.sparsifier, seq.num_tokens
        if self._sealer is not None:
            ran = self._sealer(pool, seq.slots, seq.positions)
        else:
            ran = s.maybe_apply(pool, seq.slots, seq.positions, n)
        if ran is not None:
            self.passes.append((n, zero_counts(pool, seq.slots, seq.positions, s.n_sink)))


@dataclass
class RandomZeroHook:
    """The ablation: at the token counts of another run's passes, zero elements chosen uniformly at
    random (seeded) among the non-sink positions until each (layer, KV head, K/V) holds as many zeros as
    that run's pass left there. Zeros from earlier passes stay; new ones are drawn among the nonzero
    elements."""

    schedule: Sequence[Pass]
    n_sink: int = 64
    seed: int = 0
    _gen: torch.Generator = field(init=False, repr=False)
    _todo: dict[int, torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)
        self._todo = {tokens: counts for tokens, counts in self.schedule}

    def after_step(self, pool: KVPool, seq: KVSequence) -> None:
        target = self._todo.get(seq.num_tokens)
        if target is None:
            return
        chosen = seq.slots[seq.positions >= self.n_sink]
        for layer in range(pool.layout.num_layers):
            k, v = pool.gather(layer, chosen)
            for head in range(k.shape[1]):
                self._fill(k[:, head], int(target[layer, head, 0]))
                self._fill(v[:, head], int(target[layer, head, 1]))
            pool.write(layer, chosen, k, v)

    def _fill(self, x: torch.Tensor, zeros: int) -> None:
        """Zero random nonzero elements of ``x`` (a view ``[T, D]``) until it holds ``zeros`` zeros."""
        flat = x.reshape(-1)
        nonzero = (flat != 0).nonzero().squeeze(1)
        need = zeros - (flat.numel() - nonzero.numel())
        if need > 0:
            pick = torch.randperm(nonzero.numel(), generator=self._gen)[:need]
            flat[nonzero[pick.to(flat.device)]] = 0.0
            x.copy_(flat.view_as(x))


@dataclass
class EngineRun:
    """One teacher-forced run: ``logits`` float32 ``[n - 1, vocab]``, the seconds of the token-by-token
    part (hook passes included), and the codec's stored and raw bytes of the final cached K/V."""

    logits: torch.Tensor
    seconds: float
    stored_bytes: int
    raw_bytes: int
    zeros: torch.Tensor  # int64 [L, Hkv, 2] over positions >= n_sink at the end


def teacher_forced(
    engine: Engine, ids: Sequence[int], prefill: int, hook: CacheHook, n_sink: int = 64
) -> EngineRun:
    """Feed ``ids`` (``prefill`` at once, then one by one) through a fresh sequence; see the module
    docstring. The last token is never fed (nothing predicts past it). The sequence is released after."""
    if not 1 <= prefill < len(ids):
        raise ValueError(f"prefill must be in [1, {len(ids) - 1}], got {prefill}")
    seq = engine.new_sequence()
    try:
        with torch.inference_mode():
            rows = [engine.extend(seq, list(ids[:prefill]), logits="all")]
            start = time.perf_counter()
            hook.after_step(engine.pool, seq)
            for token in ids[prefill:-1]:
                rows.append(engine.decode(seq, token)[None])
                hook.after_step(engine.pool, seq)
            seconds = time.perf_counter() - start
            stored, raw = codec_bytes(engine.pool, seq.slots)
            zeros = zero_counts(engine.pool, seq.slots, seq.positions, n_sink)
    finally:
        engine.release(seq)
    return EngineRun(torch.cat(rows).float().cpu(), seconds, stored, raw, zeros)


def codec_bytes(pool: KVPool, slots: torch.Tensor) -> tuple[int, int]:
    """(stored, raw) bytes of the K/V at ``slots`` (int64 ``[T]``, cache order) as the chunk store would
    encode them: cut into runs of ``block_size`` tokens, each run's K and V (``[num_layers, n, Hkv, D]``)
    encoded by :func:`kvos.memory.codec.encode`, dense or sparse, whichever is smaller."""
    stored = raw = 0
    size = pool.layout.block_size
    for lo in range(0, slots.numel(), size):
        part = slots[lo : lo + size]
        pairs = [pool.gather(layer, part) for layer in range(pool.layout.num_layers)]
        for x in (torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])):
            enc = encode(x.cpu())
            stored += enc.nbytes
            raw += enc.raw_bytes
    return stored, raw


@dataclass(frozen=True)
class Agreement:
    """Per-position comparison of a run with the full cache (each ``[n - 1]``, float64 or bool)."""

    nll: torch.Tensor
    top1: torch.Tensor
    kl: torch.Tensor


def compare(logits: torch.Tensor, full: torch.Tensor, targets: torch.Tensor) -> Agreement:
    """``logits``, ``full``: float32 ``[n, vocab]``; ``targets``: int64 ``[n]``, the true next tokens.
    nll: -log p(target) under ``logits``; top1: argmax agrees with the full cache's; kl: KL(full || run)
    in nats."""
    logp = F.log_softmax(logits.double(), dim=-1)
    full_logp = F.log_softmax(full.double(), dim=-1)
    nll = -logp.gather(1, targets[:, None]).squeeze(1)
    kl = (full_logp.exp() * (full_logp - logp)).sum(dim=-1).clamp_min(0.0)
    return Agreement(nll, logits.argmax(dim=-1) == full.argmax(dim=-1), kl)


def perplexity(nll: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood (``nll``: ``[n]`` nats)."""
    return math.exp(float(nll.mean()))


def concat(parts: Sequence[Agreement]) -> Agreement:
    """The positions of several windows as one."""
    return Agreement(
        torch.cat([p.nll for p in parts]),
        torch.cat([p.top1 for p in parts]),
        torch.cat([p.kl for p in parts]),
    )
