"""Per-head token budgets on the engine's own sequences, driven by a token policy.

:class:`BudgetedSequence` is an ordinary :class:`~kvos.engine.sequence.Sequence` of an
:class:`~kvos.engine.engine.Engine` whose tokens are kept per KV head (:mod:`kvos.engine.head_segments`):
after each step its new tokens join the per-head segment, and every (layer, KV head) holding more than its
budget drops down to it as the policy chooses (:mod:`kvos.policy.token_select`), giving its head-blocks
back to the pool. What the policies read is recorded from the attention the engine captures (every layer,
cache order): each token's attention summed over every query so far, and the last queries' mean (SnapKV's
observation window). A KV head's importance is the MAXIMUM over the query heads that read it: a token one
query head relies on is needed even when the other heads of its group ignore it, and it matches the
calibration, where a KV head takes the maximum entropy of its query heads.

:func:`run_budgeted` streams a text through it, teacher-forced, so the logits of every position can be
compared with a full cache's; ``kvos bench quality`` uses it for the budget policies (uniform, entropy and
the baselines). :func:`compress_prompt` compresses a prompt once, as sessions compress each chunk
(``kvos generate --kv-compression entropy``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvos.engine.engine import Engine
from kvos.engine.head_segments import compress_heads, fold_tail
from kvos.engine.sequence import Segment
from kvos.engine.sequence import Sequence as Sequence_
from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.pool import KVPool
from kvos.model.transformer import Transformer
from kvos.policy.compression import Compression
from kvos.policy.entropy import HeadBudgets
from kvos.policy.token_select import (
    DEFAULT_SINKS,
    HeadState,
    Row,
    SnapKV,
    TokenPolicy,
    make_policy,
    observed_keep,
)

OBSERVATION_WINDOW = 32


class BudgetedSequence:
    """One sequence of ``engine`` whose (layer, KV head)s each hold at most a policy's budget of tokens.

    Models with linear-attention layers, layers that reuse another layer's K/V or sliding-window layers
    kept apart by the pool are refused (ConfigError). Extend it by whole prefills or single tokens; a
    prefill runs as one pass (the captured attention covers every query of it).
    """

    def __init__(self, engine: Engine, policy: TokenPolicy, window: int = OBSERVATION_WINDOW) -> None:
        c = engine.model.config
        if c.recurrent_layers or c.num_kv_layers != c.num_layers or engine.pool.slides:
            raise ConfigError(
                "per-head budgets need every layer to keep K/V of its own, for every token: this model has "
                "linear-attention layers, layers that share another layer's K/V, or sliding-window layers"
            )
        self.engine, self.policy, self.window = engine, policy, window
        self.seq = engine.new_sequence()
        self.group, self.num_kv = c.group_size, c.num_kv_heads
        self._layers = frozenset(range(c.num_layers))
        self._cum = torch.zeros(c.num_layers, c.num_heads, 0, dtype=torch.float32)  # cache order
        self._recent: list[tuple[torch.Tensor, int]] = []  # (mean of the last queries [L, H, T], how many)
        # SnapKV reads the observation window; every other policy the sums over every query
        self._observe_window = isinstance(policy, SnapKV) and window > 0

    # ------------------------------------------------------------------ sizes
    @property
    def rows(self) -> list[Row]:
        """Every (layer, kv_head), layer-major."""
        return [(layer, h) for layer in sorted(self._layers) for h in range(self.num_kv)]

    @property
    def next_position(self) -> int:
        return self.seq.next_position()

    def kept(self, layer: int, kv_head: int) -> torch.Tensor:
        """int64 [T] cache-order indices (= positions) of the tokens one (layer, KV head) holds."""
        part = self.seq.segments[0].heads if self.seq.segments else None
        if part is None:
            return torch.arange(self.seq.num_tokens)
        return part.kept[layer * self.num_kv + kv_head]

    def num_tokens(self, layer: int, kv_head: int) -> int:
        """Tokens held by one (layer, KV head)."""
        return int(self.kept(layer, kv_head).shape[0])

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one head-block (K and V of one KV head of one layer for a block's tokens)."""
        return self.engine.pool.head_store().bytes_per_block

    @property
    def resident_bytes(self) -> int:
        """Pool bytes this sequence holds: its blocks and its head-blocks."""
        lay = self.engine.pool.layout
        return self.seq.num_blocks * lay.bytes_per_block + self.seq.num_head_blocks * self.head_block_bytes

    def uniform_bytes(self) -> int:
        """Bytes a uniform split of the tokens held now (same total, every row alike) would allocate."""
        rows = self.rows
        per_row = -(-sum(self.num_tokens(*row) for row in rows) // len(rows))
        blocks = len(rows) * -(-per_row // self.engine.pool.layout.block_size)
        return blocks * self.head_block_bytes

    # ---------------------------------------------------------------- forward
    def extend(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Run tokens at the next positions; returns float32 logits [n, vocab]. Their K/V then join the
        per-head segment, held by every row until :meth:`enforce`."""
        ids = list(token_ids)
        if not ids:
            raise InvalidPositionError("extend needs at least one token")
        n = len(ids)
        w = min(self.window, n) if self._observe_window else n
        captured: dict[int, torch.Tensor] = {}
        logits = self.engine.extend(
            self.seq, ids, logits="all", capture_layers=self._layers, captured=captured, capture_window=w
        )
        means = torch.stack([captured[layer].float().cpu() for layer in sorted(self._layers)])  # [L, H, T]
        self._record(means, w)
        everything = [list(range(n))] * len(self.rows)
        if len(self.seq.segments) == 1:
            compress_heads(self.engine, self.seq, self.seq.segments[0], everything)
        else:
            fold_tail(self.engine, self.seq, everything)
        return logits

    def _record(self, means: torch.Tensor, queries: int) -> None:
        """Add the captured means (over the pass's last ``queries`` queries) to what the policies read."""
        t = means.shape[2]
        grown = torch.zeros(*means.shape[:2], t)
        grown[..., : self._cum.shape[2]] = self._cum
        self._cum = grown
        if not self._observe_window:
            self._cum += means * queries  # the mean over every query of the pass, times how many
            return
        self._recent.append((means, queries))
        while sum(n for _, n in self._recent[1:]) >= self.window:
            self._recent.pop(0)

    def window_scores(self) -> torch.Tensor | None:
        """float32 [L, H, T] mean attention of the last <= ``window`` queries (None when not observed). A
        pass only part of whose queries fall in the window counts with that share of its mean."""
        if not self._recent:
            return None
        t = self.seq.num_tokens
        total, weight = torch.zeros(*self._cum.shape[:2], t), 0
        for i, (means, n) in enumerate(reversed(self._recent)):
            share = min(n, self.window - weight) if i else n
            total[..., : means.shape[2]] += means * share
            weight += share
        return total / weight

    # ----------------------------------------------------------------- policy
    def state(self, layer: int, kv_head: int, window: torch.Tensor | None = None) -> HeadState:
        """The policy's view of one (layer, KV head); ``window``: :meth:`window_scores` if wanted."""
        kept = self.kept(layer, kv_head)
        heads = slice(kv_head * self.group, (kv_head + 1) * self.group)
        positions = self.seq.positions[kept].clone()
        cum = self._cum[layer, heads][:, kept]  # [G, T]
        seen = (self.next_position - positions).clamp_min(1).float()
        return HeadState(
            layer=layer,
            kv_head=kv_head,
            positions=positions,
            cumulative=cum.max(dim=0).values,
            mean_attention=(cum / seen).max(dim=0).values,
            window=None if window is None else window[layer, heads][:, kept].max(dim=0).values,
            next_position=self.next_position,
        )

    def enforce(self, budgets: Mapping[Row, int]) -> int:
        """Drop tokens of every row that holds more than its budget, as the policy selects; returns the
        pool bytes given back."""
        rows = self.rows
        over = [row for row in rows if self.num_tokens(*row) > budgets[row]]
        if not over:
            return 0
        window = self.window_scores()
        keep = [self.kept(*row) for row in rows]
        for layer, h in over:
            chosen = self.policy.select(self.state(layer, h, window), budgets[layer, h])
            keep[layer * self.num_kv + h] = keep[layer * self.num_kv + h][chosen]
        return compress_heads(self.engine, self.seq, self.seq.segments[0], [k.tolist() for k in keep])

    def release(self) -> None:
        """Give every block and head-block back."""
        self.seq.release()


@dataclass
class BudgetedRun:
    """Result of :func:`run_budgeted`.

    logits: float32 [n_tokens - 1, vocab]: row i predicts token i + 1 from tokens[: i + 1].
    resident_bytes: mean over steps of the K/V bytes the sequence holds in the pool (its head-blocks x
        bytes per head-block), measured after each step's eviction.
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
    ids = token_ids[:-1]  # the last token is only ever predicted
    first = min(max(prefill, 1), len(ids))
    engine = Engine(model, block_size, prefill_slice=first)  # the prefill in one pass
    cache = BudgetedSequence(engine, chooser)
    outputs, resident, uniform = [], [], []
    for step in [ids[:first]] + [[t] for t in ids[first:]]:
        outputs.append(cache.extend(step))
        cache.enforce(chooser.budgets(cache.next_position, budget_tokens, cache.rows))
        resident.append(cache.resident_bytes)
        uniform.append(cache.uniform_bytes())
    return BudgetedRun(
        logits=torch.cat(outputs).float(),
        resident_bytes=math.fsum(resident) / len(resident),
        uniform_bytes=math.fsum(uniform) / len(uniform),
        seconds=time.perf_counter() - start,
    )


def compress_prompt(
    engine: Engine,
    seq: Sequence_,
    token_ids: Sequence[int],
    compression: Compression,
    sink_count: int = DEFAULT_SINKS,
    window: int = OBSERVATION_WINDOW,
    logits: Literal["none", "all"] = "none",
) -> torch.Tensor:
    """Prefill ``token_ids`` into a new segment of ``seq`` and compress it once (``kvos generate
    --kv-compression``: nothing reads the prompt after its own last queries but the reply): sparsified (when
    ``compression`` has a sparsifier), then each (layer, KV head) keeps its budget of the tokens
    (:meth:`HeadBudgets.for_chunk`): the history's first ``sink_count`` and the best of the last ``window``
    queries' attention (:func:`observed_keep`). Returns what the prefill returned (``logits``: "all", float
    [n, vocab] as the tokens were written, before any was dropped)."""
    seg, out, captured = _prefill(engine, seq, token_ids, compression, logits, window)
    n = seg.num_tokens
    if compression.budgets is not None and n:
        _cut_by(engine, seq, seg, captured, compression.budgets, sink_count)
    return out


def _prefill(
    engine: Engine,
    seq: Sequence_,
    token_ids: Sequence[int],
    compression: Compression,
    logits: Literal["none", "all"],
    window: int,
) -> tuple[Segment, torch.Tensor, dict[int, torch.Tensor]]:
    """Prefill ``token_ids`` into a new segment of ``seq``, sparsified when ``compression`` has a sparsifier;
    with per-head budgets, every layer's mean attention of the last ``window`` queries is captured (layer ->
    float [num_heads, T], in cache order). Returns the segment, what the prefill returned and the capture."""
    lay = engine.pool.layout
    seg = seq.open_segment()
    first, n = seq.next_position(), len(token_ids)
    captured: dict[int, torch.Tensor] = {}
    layers = frozenset(range(lay.num_layers)) if compression.budgets is not None else frozenset()
    out = engine.extend(seq, token_ids, None, logits, layers, captured, window if layers else 0)
    sparsifier = compression.sparsifier
    if sparsifier is not None:
        positions = torch.arange(first, first + n, dtype=torch.int64)

        def sparsify(pool: KVPool, slots: torch.Tensor) -> object:
            return sparsifier.apply(pool, slots, positions.to(slots.device))

        engine.edit_kv(seq, seg, 0, sparsify)
    return seg, out, captured


def _cut_by(
    engine: Engine,
    seq: Sequence_,
    seg: Segment,
    captured: dict[int, torch.Tensor],
    budgets: HeadBudgets,
    sink_count: int,
) -> None:
    """Cut the whole ``seg``'s heads by ``captured`` (an observation of the cache as it is now, layer ->
    float [num_heads, T] in cache order)."""
    lo = seq.boundaries()[next(i for i, other in enumerate(seq.segments) if other is seg)]
    n = seg.num_tokens
    first = int(seg.positions[0]) if n else 0
    probs = [captured[layer][:, lo : lo + n] for layer in range(engine.pool.layout.num_layers)]
    cut_heads(engine, seq, seg, probs, budgets, max(0, min(sink_count - first, n)))


def cut_heads(
    engine: Engine,
    seq: Sequence_,
    seg: Segment,
    probs: Sequence[torch.Tensor],
    budgets: HeadBudgets,
    sinks: int,
) -> int | None:
    """Cut the whole segment ``seg``'s KV heads to their ``budgets`` of its ``n`` tokens, each keeping its
    first ``sinks`` and the best by ``probs`` (per layer, float [num_heads, n]: an observation window's
    attention to them, :func:`observed_keep`). Returns the pool bytes given back, or None when every head
    keeps every token (nothing is cut). PoolOutOfMemoryError as :func:`compress_heads`."""
    lay, n = engine.pool.layout, seg.num_tokens
    sizes = budgets.for_chunk(n, lay.num_layers, lay.num_kv_heads, lay.block_size)
    keep = observed_keep(probs, sizes, lay.num_kv_heads, sinks)
    if all(len(row) == n for row in keep):
        return None
    return compress_heads(engine, seq, seg, keep)


@dataclass
class ChunkedRun:
    """A text read as a session reads a document: ``logits`` float32 ``[n - 1, vocab]`` (position ``i``
    predicts token ``i + 1``), the seconds it took, the pool bytes its K/V held at the end and the bytes the
    same tokens take whole."""

    logits: torch.Tensor
    seconds: float
    resident_bytes: int
    dense_bytes: int


def run_chunked(
    engine: Engine, token_ids: Sequence[int], compression: Compression, chunk: int = 128
) -> ChunkedRun:
    """Prefill ``token_ids`` ``chunk`` tokens at a time into a fresh sequence, as a session reads a
    document (:mod:`kvos.session.compressor`): each chunk sparsified after its prefill, and its heads cut to
    their budgets by the next chunk's observation window (the queries that read it next; the last chunk
    stays whole). Returns the logits each token got and the bytes held (``kvos bench quality``'s
    ``session-entropy`` and ``session-uniform``)."""
    seq = engine.new_sequence()
    began = time.perf_counter()
    parts, waiting = [], None
    try:
        for lo in range(0, len(token_ids), chunk):
            seg, out, captured = _prefill(
                engine, seq, token_ids[lo : lo + chunk], compression, "all", OBSERVATION_WINDOW
            )
            parts.append(out)
            if compression.budgets is None:
                continue
            if waiting is not None:
                _cut_by(engine, seq, waiting, captured, compression.budgets, DEFAULT_SINKS)
            waiting = seg
        seconds = time.perf_counter() - began
        resident = engine.pool.live_bytes
    finally:
        engine.release(seq)
    dense = len(token_ids) * engine.pool.layout.bytes_per_token
    return ChunkedRun(torch.cat(parts)[:-1].float(), seconds, resident, dense)
