"""Applying a session's K/V compression to its chunks as they are sealed (:mod:`kvos.policy.compression`).

A chunk is sealed when no more tokens will be written into it: a prompt chunk once prefilled (but the
generation prompt's ASSISTANT chunk, which the reply continues), a reply chunk once full or once the reply
ends.

- Sparsification: :meth:`ChunkCompressor.seal` sparsifies the tokens written since the chunk was last
  sealed (``Chunk.compressed_tokens`` on), in the pool, through the engine's copy-on-write edit: a branch
  that shares the blocks keeps its own copy. Deterministic: the same chunk in the same state gets the same
  zeros, so a session that evicts and restores holds what one that never evicted holds.
- Per-head budgets: a sealed prompt chunk waits for the queries that read it next: the next prefilled
  chunk of at least 8 tokens (its last 32 queries, SnapKV's observation window, every layer: the next part
  of a document, the question after a reply), or else the queries that come (a generation prompt's, the
  reply's decode steps) until 32 have seen it. Cut by its own prefill's last queries instead, a document
  kept 5 points less top-1 agreement with the full cache (docs/benchmarks.md): those queries look at its
  own end, not at what later text needs of it. A reply chunk is chosen by the decode steps that wrote it
  when it is sealed (or, when the prompt wrote its first tokens, waits as a prompt chunk does). Each (layer,
  KV head) then
  keeps its budget (:meth:`HeadBudgets.for_chunk`) of the chunk's tokens: the history's first
  ``sink_count`` tokens, then the tokens its query heads attend to most (summed over the group,
  max-pooled over 7 neighbours as SnapKV clusters them). Only chunks of the configured kinds
  (``SessionConfig.head_budget_kinds``: replies, tool results and documents) are cut.
  :func:`~kvos.engine.head_segments.compress_heads` moves the kept K/V into the head store and gives the
  chunk's blocks back. A chunk is chosen once; its heads keep their tokens wherever it goes (paged out and
  in, saved, shared). A chunk paged out while it waits gathers again once it is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from kvos.engine.engine import Engine
from kvos.errors import ConfigError, PoolOutOfMemoryError
from kvos.memory.pool import KVPool
from kvos.policy.budgeted import OBSERVATION_WINDOW, cut_heads
from kvos.policy.chunks import Chunk
from kvos.policy.compression import Compression
from kvos.policy.sparsify import MagnitudeSparsifier, SparsifyReport, snap_keys_
from kvos.session.pager import Pager

_log = logging.getLogger(__name__)

# a prefilled chunk this long reads the chunks waiting before it well enough to choose for them; shorter ones
# (a generation prompt's 3-5 tokens, which attend to the end of the cache) only add to what they gathered
PREFILL_WINDOW = 8


class ChunkCompressor:
    """One session's compression, and what it zeroed, dropped and the seconds it took since this process
    made the session (what each chunk holds is its own record: ``Chunk.compressed_tokens``, its segment's
    per-head table)."""

    def __init__(
        self,
        method: Compression | None,
        engine: Engine,
        sink_count: int = 4,
        kinds: Iterable[str] = ("assistant", "tool", "document"),
    ) -> None:
        self.engine, self.sink_count = engine, sink_count
        self.kinds = frozenset(kinds)  # the kinds of chunk whose heads keep their own budgets
        self.method: Compression | None = None
        self.set(method)
        self.report = SparsifyReport()
        self.seconds = 0.0
        self.awaiting: dict[int, _Watch] = {}  # sealed chunks waiting for later queries: what they got so far
        self.watched: dict[int, _Watch] = {}  # reply chunks being written: the attention they got so far
        self.own: dict[int, list[torch.Tensor]] = {}  # prefilled, not sealed: their own window's attention
        self.chosen: set[int] = set()  # chunks whose heads chose (even if each kept every token): once only
        self.head_chunks = 0  # chunks whose heads chose their tokens in this process
        self.head_bytes_freed = 0

    def set(self, method: Compression | None) -> None:
        """Compress the chunks sealed from now on by ``method``; ConfigError when its per-head budgets do
        not fit the model (another model's calibration; sliding-window layers)."""
        if method is not None and method.budgets is not None:
            lay = self.engine.pool.layout
            method.budgets.for_chunk(1, lay.num_layers, lay.num_kv_heads, lay.block_size)
            if self.engine.pool.slides:
                raise ConfigError("per-head entropy budgets do not run on models with sliding-window layers")
        self.method = method

    def watches(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s heads keep their own budgets: per-head budgets on, and a kind they cut."""
        return self.observes and chunk.kind.value in self.kinds

    def listens(self, chunk: Chunk, pager: Pager) -> bool:
        """Whether a forward pass writing ``chunk`` should capture every layer's attention (for :meth:`watch`
        or :meth:`prefilled`): the chunk is of a kind cut (it will wait, or be chosen by its own decode
        steps), or resident sealed chunks wait for the queries that read them next."""
        if not self.observes:
            return False
        return self.watches(chunk) or any(cid in pager.segments for cid in self.awaiting)

    def watch(self, chunk: Chunk, captured: dict[int, torch.Tensor], pager: Pager) -> None:
        """Add one decode step's attention (layer -> float [num_heads, T], every layer, in cache order, the
        chunk being written last) to what ``chunk``'s tokens received (its heads choose by it when it is
        sealed) and to what the waiting chunks received (:meth:`_observe`)."""
        n = chunk.num_tokens
        if not captured:
            return
        began = time.perf_counter()
        if n and self.watches(chunk):
            watch = self.watched.get(chunk.chunk_id)
            if watch is None:
                heads = next(iter(captured.values())).shape[0]
                watch = self.watched[chunk.chunk_id] = _Watch(heads, len(captured), max(n, 128))
            watch.add([captured[layer][:, -n:] for layer in range(len(captured))])
        self._observe(pager, captured, 1)
        self.seconds += time.perf_counter() - began

    @property
    def observes(self) -> bool:
        """Whether prefills should capture every layer's attention for :meth:`choose_heads`."""
        return self.method is not None and self.method.budgets is not None

    def pending(self, chunk: Chunk, pager: Pager) -> bool:
        """Whether a seal of ``chunk`` has sparsification to do: a sparsifier, the chunk resident and whole,
        tokens not yet compressed."""
        seg = pager.segments.get(chunk.chunk_id)
        sparse = self.method is not None and self.method.sparsifier is not None
        return sparse and seg is not None and seg.heads is None and chunk.compressed_tokens < chunk.num_tokens

    def seal(self, chunk: Chunk, pager: Pager) -> float:
        """Compress the resident ``chunk``: sparsify its tokens from ``chunk.compressed_tokens`` on, and with
        per-head budgets, choose its heads' tokens by the decode steps that wrote it (a reply whose steps saw
        every token) or let it wait for the queries that read it next (:meth:`_observe`). Returns the
        seconds it took. When a private copy of a block shared with a branch cannot be allocated, the chunk
        is left as it is for a later seal."""
        began = time.perf_counter()
        if self.pending(chunk, pager):
            self._sparsify(chunk, pager)
        watch, n = self.watched.pop(chunk.chunk_id, None), chunk.num_tokens
        seg = pager.segments.get(chunk.chunk_id)
        whole = seg is not None and seg.heads is None
        whole = whole and chunk.chunk_id not in self.awaiting and chunk.chunk_id not in self.chosen
        if self.watches(chunk) and whole and n:
            if watch is not None and watch.covers(n):
                self._choose(pager, chunk, watch.means(n))
            else:
                self.wait(chunk, self.own.get(chunk.chunk_id))
        self.own.pop(chunk.chunk_id, None)
        seconds = time.perf_counter() - began
        self.seconds += seconds
        return seconds

    def wait(self, chunk: Chunk, own: list[torch.Tensor] | None = None) -> None:
        """``chunk`` (whole, sealed) waits for the queries that read it next; ``own``: its own prefill's last
        queries' attention to it (per layer, [num_heads, n]), for when it must leave before any read it."""
        n = chunk.num_tokens
        heads, layers = self.engine.model.config.num_heads, self.engine.pool.layout.num_layers
        watch = self.awaiting[chunk.chunk_id] = _Watch(heads, layers, n)
        watch.own = own if own is not None and own[0].shape[-1] == n else None

    def gathered(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """What each waiting chunk gathered (a snapshot's): float32 sums [layers, num_heads, n] of the
        attention its readers gave it, how many read each token [n], its own window's [layers, num_heads, n]
        or None."""
        return {
            cid: (w.sums.clone(), w.counts.clone(), None if w.own is None else torch.stack(w.own))
            for cid, w in self.awaiting.items()
        }

    def resume(
        self, chunk: Chunk, sums: torch.Tensor, counts: torch.Tensor, own: torch.Tensor | None
    ) -> None:
        """``chunk`` waits again with what it had gathered (:meth:`gathered`); ValueError when that does not
        fit the chunk and the model."""
        heads, layers = self.engine.model.config.num_heads, self.engine.pool.layout.num_layers
        n = chunk.num_tokens
        if sums.shape != (layers, heads, n) or counts.shape != (n,):
            raise ValueError(f"chunk {chunk.chunk_id}'s gathered attention does not fit it")
        if own is not None and own.shape != sums.shape:
            raise ValueError(f"chunk {chunk.chunk_id}'s own window does not fit it")
        self.wait(chunk, None if own is None else list(own.float()))
        watch = self.awaiting[chunk.chunk_id]
        watch.sums, watch.counts = sums.float().clone(), counts.float().clone()

    def _sparsify(self, chunk: Chunk, pager: Pager) -> None:
        assert self.method is not None and self.method.sparsifier is not None
        method, seg, lo = self.method.sparsifier, pager.segments[chunk.chunk_id], chunk.compressed_tokens
        positions = torch.arange(chunk.original_start + lo, chunk.original_end, dtype=torch.int64)
        moved = (seg.positions[lo:], self.engine.model.ropes)

        def edit(pool: KVPool, slots: torch.Tensor) -> SparsifyReport:
            return method.apply(pool, slots, positions.to(slots.device), moved)

        try:
            report = self.engine.edit_kv(pager.seq, seg, lo, edit)
        except PoolOutOfMemoryError:
            _log.info("chunk %d left uncompressed: no block for a private copy", chunk.chunk_id)
            return
        chunk.compressed_tokens = chunk.num_tokens
        self.report += report

    def saved_keys(
        self, chunk: Chunk, positions: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys to save of ``chunk`` (read from the pool at ``positions``, int64 [n]; ``k`` [num_layers,
        n, kv_heads, head_dim]) and the positions they are then rotated at. Keys sparsified element by element
        go back to the frame they were thresholded in, the chunk's logical positions, where their zeros are
        snapped back (:func:`~kvos.policy.sparsify.snap_keys_`): so the store keeps them sparse after the
        cache was compacted or the chunk restored elsewhere (whatever the session's compression is now: it
        may have been switched since). Otherwise ``k`` and ``positions`` as given."""
        sparsifier = self.method.sparsifier if self.method is not None else None
        done = chunk.compressed_tokens
        if done == 0 or (sparsifier is not None and sparsifier.key_unit != "element"):
            return k, positions
        n_sink = sparsifier.n_sink if sparsifier is not None else MagnitudeSparsifier.n_sink
        logical = torch.arange(chunk.original_start, chunk.original_end, dtype=torch.int64)
        if positions.shape != logical.shape or torch.equal(positions, logical):
            return k, positions
        k = self.engine.model.ropes.reanchor(k, positions, logical)
        lo = max(0, min(done, n_sink - chunk.original_start))  # its sinks were never thresholded
        snap_keys_(k[:, lo:done])
        return k, logical

    def prefilled(self, pager: Pager, chunk: Chunk, captured: dict[int, torch.Tensor]) -> float:
        """``chunk`` was just prefilled at the end of the cache; ``captured`` is its last queries' mean
        attention (32, or all of a shorter chunk: the pager's window; layer -> float [num_heads, T], in
        cache order, every layer). The chunks waiting before it were read by them (:meth:`_observe`);
        ``chunk``'s own share is kept for when it must leave before anything reads it (:meth:`settle`).
        Returns the seconds it took."""
        began = time.perf_counter()
        n = chunk.num_tokens
        self._observe(pager, captured, min(OBSERVATION_WINDOW, n))
        if self.watches(chunk) and n:
            self.own[chunk.chunk_id] = [captured[i][:, -n:].float() for i in range(len(captured))]
        seconds = time.perf_counter() - began
        self.seconds += seconds
        return seconds

    def _observe(self, pager: Pager, captured: dict[int, torch.Tensor], queries: int) -> None:
        """Add ``queries`` queries' mean attention (as :meth:`prefilled`; 1: a decode step) to each waiting
        resident chunk. A chunk chooses its heads' tokens, by the mean over every query that saw it, once a
        prefilled chunk of at least :data:`PREFILL_WINDOW` tokens has read it (its last 32 queries, SnapKV's
        window: the next part of a document, the question after a reply), or else once 32 queries have."""
        if not self.awaiting or not queries or self.method is None or self.method.budgets is None:
            return
        lay = self.engine.pool.layout
        if len(captured) < lay.num_layers:
            raise ValueError(f"per-head budgets need every layer's attention, got {sorted(captured)}")
        start = {id(seg): at for seg, at in zip(pager.seq.segments, pager.seq.boundaries(), strict=False)}
        for cid in sorted(self.awaiting):
            resident = pager.segments.get(cid)
            if resident is None:
                continue  # paged out whole: it gathers again once it is back
            n = resident.num_tokens
            if resident.heads is not None or n != self.awaiting[cid].counts.numel():
                del self.awaiting[cid]  # cut or rewritten meanwhile
                continue
            lo = start[id(resident)]
            watch = self.awaiting[cid]
            watch.add([captured[i][:, lo : lo + n] for i in range(lay.num_layers)], queries)
            if queries >= PREFILL_WINDOW or watch.seen(n) >= OBSERVATION_WINDOW:
                del self.awaiting[cid]
                self._choose(pager, pager.chunks[cid], watch.means(n))

    def settle(self, pager: Pager, chunks: list[Chunk]) -> None:
        """The waiting ``chunks`` about to be saved choose their heads' tokens now, so that they are saved
        at their budgets: by the queries that read them so far, or, read by none yet, by their own prefill's
        last queries (SnapKV's choice)."""
        for chunk in chunks:
            watch = self.awaiting.get(chunk.chunk_id)
            seg = pager.segments.get(chunk.chunk_id)
            n = chunk.num_tokens
            if watch is None or seg is None or seg.heads is not None:
                continue
            probs = watch.means(n) if watch.seen(n) else watch.own
            if probs is None:
                continue
            began = time.perf_counter()
            del self.awaiting[chunk.chunk_id]
            self._choose(pager, chunk, probs)
            self.seconds += time.perf_counter() - began

    def _choose(self, pager: Pager, chunk: Chunk, probs: list[torch.Tensor]) -> None:
        """Cut the resident whole ``chunk``'s heads to their budgets by ``probs`` (per layer, float
        [num_heads, n]: the attention each of its ``n`` tokens got from the observation window)."""
        assert self.method is not None and self.method.budgets is not None
        n = chunk.num_tokens
        sinks = max(0, min(self.sink_count - chunk.original_start, n))
        seg = pager.segments[chunk.chunk_id]
        self.chosen.add(chunk.chunk_id)
        try:
            freed = cut_heads(self.engine, pager.seq, seg, probs, self.method.budgets, sinks)
        except PoolOutOfMemoryError:
            _log.info("chunk %d keeps all its heads' tokens: no head-blocks for it", chunk.chunk_id)
            return
        if freed is not None:
            self.head_bytes_freed += freed
            self.head_chunks += 1

    def forget(self, chunk_id: int) -> None:
        """A chunk the session no longer holds (history truncated)."""
        self.awaiting.pop(chunk_id, None)
        self.own.pop(chunk_id, None)
        self.watched.pop(chunk_id, None)
        self.chosen.discard(chunk_id)

    def stats(self) -> dict[str, object]:
        """Zeroed fractions of K and V over the tokens this process sparsified, the chunks whose heads chose
        their tokens and the pool bytes that freed, and the seconds spent."""
        r = self.report
        return {
            "k_zero_fraction": round(r.k_sparsity, 4),
            "v_zero_fraction": round(r.v_sparsity, 4),
            "head_chunks": self.head_chunks,
            "head_bytes_freed": self.head_bytes_freed,
            "compress_s": round(self.seconds, 4),
        }


class _Watch:
    """The attention a chunk got from the queries that read it: float32 sums ``[layers, num_heads, capacity]``
    over them, and how many saw each token."""

    def __init__(self, heads: int, layers: int, capacity: int) -> None:
        self.sums = torch.zeros(layers, heads, capacity)
        self.counts = torch.zeros(capacity)
        self.own: list[torch.Tensor] | None = None  # a prompt chunk's own last queries (see settle)

    def add(self, probs: list[torch.Tensor], queries: int = 1) -> None:
        """The mean attention of ``queries`` queries to the chunk's first ``n`` tokens (per layer,
        [num_heads, n]), added in one operation over every layer."""
        n = probs[0].shape[-1]
        if n > self.counts.numel():
            grow = n - self.counts.numel()
            self.sums = torch.nn.functional.pad(self.sums, (0, grow))
            self.counts = torch.nn.functional.pad(self.counts, (0, grow))
        stacked = torch.stack(probs).to(device="cpu", dtype=torch.float32)
        self.sums[:, :, :n] += stacked if queries == 1 else queries * stacked
        self.counts[:n] += queries

    def seen(self, n: int) -> int:
        """The fewest queries any of the first ``n`` tokens was seen by."""
        return int(self.counts[:n].min()) if n else 0

    def covers(self, n: int) -> bool:
        """Whether every one of the chunk's ``n`` tokens was seen by a step (the first step may come after
        tokens the prefill wrote: a reply continues the generation prompt's chunk)."""
        return n <= self.counts.numel() and bool((self.counts[:n] > 0).all())

    def means(self, n: int) -> list[torch.Tensor]:
        """The mean attention each of the ``n`` tokens got, per layer: [num_heads, n]."""
        return list(self.sums[:, :, :n] / self.counts[:n])
