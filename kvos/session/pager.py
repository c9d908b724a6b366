"""The pager: moves one session's chunks between the KV pool and the chunk store.

Each resident :class:`Chunk` owns one engine :class:`Segment`. Evicting a chunk saves its K/V (backend
``kv_restore``) or forgets them, frees its pool blocks and, in ``compact`` mode, closes the gap by
re-anchoring the keys of every later chunk. Restoring splices saved K/V back with no forward pass;
recomputing re-prefills the chunk's tokens (the ``breadcrumb`` backend's recovery).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Literal

import torch

from kvos.engine.engine import Engine
from kvos.engine.head_segments import pack_mask, read_heads, splice_heads, unpack_mask
from kvos.engine.sequence import Segment, Sequence
from kvos.errors import ConfigError, CorruptChunkError
from kvos.memory.store import ChunkStore, StoredChunk
from kvos.policy.budgeted import OBSERVATION_WINDOW
from kvos.policy.chunks import Chunk, ChunkState
from kvos.policy.digest import KeyDigest, digest_keys, unrotate
from kvos.policy.retriever import Retriever

PositionMode = Literal["compact", "sparse"]
Backend = Literal["discard", "breadcrumb", "kv_restore"]
Place = Literal["end", "place"]
# (chunk, positions int64 [n], keys [num_layers, n, kv_heads, head_dim]) -> keys to save, their positions
SavedKeys = Callable[[Chunk, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_log = logging.getLogger(__name__)


class Pager:
    """Residency of one session's chunks: which are in the pool, where, and how they leave and return."""

    def __init__(
        self,
        engine: Engine,
        store: ChunkStore | None,
        mode: PositionMode,
        backend: Backend,
        chunks: dict[int, Chunk],
    ) -> None:
        """``chunks`` is the session's registry of every chunk (resident or not), shared, keyed by id."""
        if mode not in ("compact", "sparse"):
            raise ConfigError(f"position mode must be 'compact' or 'sparse', got {mode!r}")
        if backend not in ("discard", "breadcrumb", "kv_restore"):
            raise ConfigError(f"backend must be discard, breadcrumb or kv_restore, got {backend!r}")
        if backend == "kv_restore" and store is None:
            raise ConfigError("the kv_restore backend needs a ChunkStore")
        self.engine, self.store, self.mode, self.backend = engine, store, mode, backend
        self.chunks = chunks
        self.seq: Sequence = engine.new_sequence()
        self.segments: dict[int, Segment] = {}
        self.digest_layers: tuple[
            int, ...
        ] = ()  # layers of the key digest a saved chunk keeps (none: no digest)
        self.retriever: Retriever | None = None  # when set, a chunk leaving the pool keeps its key code
        self.dropped: list[int] = []  # chunks whose saved K/V the store dropped, not yet taken
        self.saved: set[int] = set()  # chunks whose K/V this pager's store holds (resident ones: segments)
        self._opened_at: dict[int, int] = {}  # where an opened segment's first token will go
        self._order: tuple[tuple[tuple[int, ...], ...], list[int]] | None = None  # order() and its key
        # compact mode: how far the resident tokens may run past the budget (the model's positions less the
        # budget: a cache of per-head chunks holds more tokens than its charge, each at its own position)
        self.position_slack = sys.maxsize
        # called with the chunks about to be saved, before they leave (per-head budgets choose what waits)
        self.on_save: Callable[[list[Chunk]], None] | None = None
        # a chunk's keys as an eviction saves them, and their positions (sparsified keys in their own frame)
        self.saved_keys: SavedKeys | None = None

    @property
    def active_tokens(self) -> int:
        """What the session's budget counts: the resident chunks' tokens, a chunk whose KV heads keep their
        own counted by the K/V it holds (:meth:`cost_of`); and, where positions bind (compact mode, see
        :attr:`position_slack`), at least the resident tokens less the slack."""
        resident = self.seq.num_tokens
        # every token, less what per-head segments do not hold (this runs twice a token)
        charged = resident
        for seg in self.seq.head_segments():
            charged += self._cost(seg) - seg.num_tokens
        return max(charged, resident - self.position_slack)

    @property
    def resident_tokens(self) -> int:
        """The tokens in the cache (whatever each KV head keeps of them)."""
        return self.seq.num_tokens

    def cost_of(self, chunk_id: int) -> int | None:
        """A resident chunk's charge to the budget when its KV heads keep their own tokens: the tokens'
        worth of K/V its rows hold, ``ceil(sum of each row's tokens / rows)``; None otherwise (its tokens)."""
        seg = self.segments.get(chunk_id)
        return None if seg is None or seg.heads is None else self._cost(seg)

    @staticmethod
    def _cost(seg: Segment) -> int:
        if seg.heads is None:
            return seg.num_tokens
        kept = seg.heads.kept
        return -(-sum(int(row.shape[0]) for row in kept) // len(kept))

    # ------------------------------------------------------------------ the record of residency
    def state_of(self, chunk_id: int) -> ChunkState:
        """Where a chunk of this session has its K/V: the one record of it (:class:`Placement`)."""
        if chunk_id in self.segments:
            return ChunkState.RESIDENT
        return ChunkState.SAVED if chunk_id in self.saved else ChunkState.DISCARDED

    def start_of(self, chunk_id: int) -> int | None:
        """The cache position of a resident chunk's first token (None when it is not resident)."""
        seg = self.segments.get(chunk_id)
        if seg is None:
            return None
        return seg.first_position if seg.num_tokens else self._opened_at[chunk_id]

    def place(self, chunk: Chunk) -> None:
        """Make this pager the chunk's placement (its state and position are read from here)."""
        chunk.placement = self

    def next_position(self, chunk: Chunk) -> int:
        """Where a new chunk's first token goes: its logical position (sparse) or the cache end (compact)."""
        return chunk.original_start if self.mode == "sparse" else self.seq.next_position()

    def open(self, chunk: Chunk, start: int | None = None) -> Segment:
        """Start a new chunk at the end of the cache (at position ``start``, by default where the mode puts
        a new chunk); the caller then extends the sequence with its tokens."""
        seg = self.seq.open_segment()
        self.place(chunk)
        self.saved.discard(chunk.chunk_id)
        self._opened_at[chunk.chunk_id] = self.next_position(chunk) if start is None else start
        self.segments[chunk.chunk_id] = seg
        return seg

    def append(
        self,
        chunk: Chunk,
        logits: Literal["last", "none"] = "none",
        captured: dict[int, torch.Tensor] | None = None,
        capture_layers: frozenset[int] = frozenset(),
        start: int | None = None,
        tap: frozenset[int] = frozenset(),
        queries: dict[int, torch.Tensor] | None = None,
        absorb: bool = True,
    ) -> torch.Tensor:
        """Prefill a new chunk at the end of the cache; returns the last logits [1, vocab] or hidden states.
        With ``capture_layers``, the attention of the chunk's last 32 queries goes into ``captured``; the
        queries of layers ``tap`` go into ``queries``. ``absorb=False`` for a chunk the history holds already
        (a recompute): a hybrid model's recurrent state stays as it is (:meth:`Engine.extend`).
        All or nothing: if the pool runs out, the chunk leaves no trace and the error propagates."""
        seg = self.open(chunk, start)
        chunk.key_code = None  # new K/V: a code made from the old ones no longer holds
        first = int(chunk.current_start or 0)
        positions = range(first, first + chunk.num_tokens)
        window = OBSERVATION_WINDOW if capture_layers else 0
        try:
            return self.engine.extend(
                self.seq,
                chunk.token_ids,
                positions,
                logits,
                capture_layers,
                captured,
                window,
                tap,
                queries,
                absorb,
            )
        except BaseException:
            del self.segments[chunk.chunk_id]
            self.engine.evict(self.seq, seg)  # discarded: neither resident nor saved
            raise

    def blocks_for(self, tokens: int, into: Chunk | None = None) -> int:
        """The pool blocks to ask for before writing ``tokens`` tokens into ``into``'s segment (default: a
        new segment): what the write allocates, plus, at worst, a private copy of each block this session
        shares with a branch (re-anchoring keys or writing into a shared block copies it first). The
        shared blocks are counted only when the pool cannot take every block of the session besides."""
        seg = self.segments.get(into.chunk_id) if into is not None else None
        pool = self.engine.pool
        need = (
            seg.page_table.blocks_needed(tokens) if seg is not None else -(-tokens // pool.layout.block_size)
        )
        if pool.can_allocate(need + self.seq.num_blocks):
            return need
        refcount = pool.allocator.refcount
        return need + sum(1 for seg in self.seq.segments for b in seg.page_table.blocks if refcount(b) > 1)

    def order(self) -> list[int]:
        """Resident chunk ids in cache order. It depends only on which segment objects the cache holds, in
        order, and which segment each chunk has, so it is kept under those objects' ids and found again
        while they hold (every decoded token asks: a Python pass over 128 chunks cost ~15 us)."""
        key = (
            tuple(map(id, self.seq.segments)),
            tuple(self.segments),
            tuple(map(id, self.segments.values())),
        )
        if self._order is None or self._order[0] != key:
            by_seg = {id(seg): cid for cid, seg in self.segments.items()}
            self._order = (key, [by_seg[id(seg)] for seg in self.seq.segments if id(seg) in by_seg])
        return list(self._order[1])

    def evict(self, chunks: list[Chunk], as_they_are: bool = False) -> int:
        """Take chunks out of the pool (saving their K/V for kv_restore); returns the tokens freed. Saved keys
        go through :attr:`saved_keys` unless ``as_they_are`` (a swap-out, which comes back where it was)."""
        if self.backend == "kv_restore" and self.on_save is not None:
            self.on_save(chunks)
        freed = 0
        for chunk in chunks:
            seg = self.segments.pop(chunk.chunk_id)
            self._opened_at.pop(chunk.chunk_id, None)
            if self.backend == "kv_restore":
                assert self.store is not None
                k, v, meta = self.read(seg)
                if self.digest_layers:
                    chunk.digest = digest_keys(k, seg.positions, self.engine.model.ropes, self.digest_layers)
                if self.retriever is not None and chunk.key_code is None:
                    chunk.key_code = self._code(k, seg.positions)
                if self.saved_keys is not None and not as_they_are:
                    k, positions = self.saved_keys(chunk, seg.positions, k)
                    meta["positions"] = positions.tolist()
                self.saved.add(chunk.chunk_id)  # before put: a store over its caps may drop it at once
                self.store.put(chunk.chunk_id, k, v, meta, copy=False)
                self._reap()  # a store over its caps may have dropped this chunk or older ones
            else:
                if self.digest_layers and self.backend == "breadcrumb":
                    chunk.digest = self.digest(chunk, seg)
                if self.retriever is not None and self.backend == "breadcrumb":
                    self.key_code(chunk, seg)
            freed += seg.num_tokens
            self.engine.evict(self.seq, seg)
        if self.mode == "compact":
            self.compact()
        return freed

    def read(self, seg: Segment) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
        """A resident segment's K and V ([num_layers, n, num_kv_heads, head_dim] each) and the metadata a
        chunk file keeps beside them, which :meth:`splice` takes back: its positions, how much of it the
        sliding-window layers hold and, for a segment whose KV heads keep their own tokens, which
        (:func:`~kvos.engine.head_segments.pack_mask`; the K/V are zero where a head holds no token)."""
        meta: dict[str, object] = {"positions": seg.positions.tolist(), "held_from": seg.held_from}
        if seg.heads is None:
            k, v = self.engine.read_kv(seg)
        else:
            k, v, mask = read_heads(self.engine, seg)
            meta["head_mask"] = pack_mask(mask)
        return k, v, meta

    def splice(
        self, index: int, chunk: Chunk, saved: StoredChunk, old: torch.Tensor, new: torch.Tensor
    ) -> Segment:
        """Put a saved chunk back at ``index`` in cache order, its keys moved from ``old`` to ``new``
        positions (int64 [n]), no forward pass: its KV heads keep the tokens they kept when it was saved."""
        text = saved.meta.get("head_mask")
        if text is None:
            return self.engine.splice(
                self.seq, index, chunk.token_ids, saved.k, saved.v, old, new, held_from(saved)
            )
        lay = self.engine.pool.layout  # (the store checks a chunk file's metadata with its K/V)
        mask = unpack_mask(str(text), lay.num_layers, lay.num_kv_heads, chunk.num_tokens)
        return splice_heads(self.engine, self.seq, index, chunk.token_ids, saved.k, saved.v, mask, old, new)

    def compact(self) -> None:
        """Give resident tokens contiguous positions in cache order, re-anchoring keys that move."""
        start, empty = 0, {}
        for seg in self.seq.segments:
            n = seg.num_tokens
            if not n:
                empty[id(seg)] = start  # an opened chunk still without tokens: its first goes here
            elif int(seg.positions[0]) != start:
                self.engine.reposition(self.seq, seg, torch.arange(start, start + n))
            start += n
        for cid, seg in self.segments.items():
            if id(seg) in empty:
                self._opened_at[cid] = empty[id(seg)]

    def digest(self, chunk: Chunk, seg: Segment | None = None) -> KeyDigest:
        """The key digest of a resident chunk (of ``seg``, its segment, once it has left ``segments``),
        from its keys in the pool (needs ``digest_layers``)."""
        seg = seg if seg is not None else self.segments[chunk.chunk_id]
        k, _, _ = self.read(seg)
        return digest_keys(k, seg.positions, self.engine.model.ropes, self.digest_layers)

    def key_codes(self, chunks: list[Chunk]) -> list[torch.Tensor | None]:
        """The retriever's codes of these chunks' keys (:meth:`Retriever.code`, float16 ``[n, rank]``
        each): kept on a chunk once made; the missing ones made now, the resident chunks' together from
        their keys in the pool (one gather and one rotation for all), a saved chunk's from the store (a
        session restored from a state directory keeps no codes). None for a chunk whose K/V are gone
        (discarded): it cannot be scored. Needs :attr:`retriever`."""
        assert self.retriever is not None
        resident = [c for c in chunks if c.key_code is None and c.chunk_id in self.segments]
        for chunk in [c for c in resident if self.segments[c.chunk_id].heads is not None]:
            self.key_code(chunk)  # its heads keep their own tokens: read whole, zeros where dropped
        resident = [c for c in resident if c.key_code is None]
        if resident:
            segs = [self.segments[c.chunk_id] for c in resident]
            keys = self.engine.read_keys(torch.cat([s.slots for s in segs]), self.retriever.key_layers)
            codes = self._code(keys, torch.cat([s.positions for s in segs]))
            for chunk, code in zip(resident, codes.split([s.num_tokens for s in segs]), strict=True):
                chunk.key_code = code.clone()
        for chunk in chunks:
            if chunk.key_code is None and self.store is not None and chunk.chunk_id in self.store:
                try:
                    saved = self.store.get(chunk.chunk_id)
                except CorruptChunkError as e:  # left unscored; restoring it will recompute it
                    _log.warning("%s: not scored", e)
                    continue
                finally:
                    self._reap()
                chunk.key_code = self._code(saved.k, saved.meta_int64("positions"))
        return [c.key_code for c in chunks]

    def key_code(self, chunk: Chunk, seg: Segment | None = None) -> torch.Tensor:
        """One chunk's code (see :meth:`key_codes`; ``seg``: its segment, once it has left ``segments``)."""
        if chunk.key_code is None:
            assert self.retriever is not None
            seg = seg if seg is not None else self.segments[chunk.chunk_id]
            if seg.heads is None:
                keys = self.engine.read_keys(seg.slots, self.retriever.key_layers)
            else:
                keys = self.read(seg)[0].to(self.engine.model.dtype)
            chunk.key_code = self._code(keys, seg.positions)
        return chunk.key_code

    def _code(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k: ``[layers, n, kv_heads, head_dim]`` at ``positions`` (every layer, or the retriever's key
        layers) -> the code, float16 ``[n, rank]``: every layer rotated back to position 0 at once."""
        assert self.retriever is not None
        chosen = k if k.shape[0] == len(self.retriever.key_layers) else k[list(self.retriever.key_layers)]
        layers, n, kv, dim = chosen.shape
        ropes = self.engine.model.ropes
        if ropes.uniform is not None:
            flat = chosen.permute(1, 0, 2, 3).reshape(n, layers * kv, dim)  # the layers as more heads
            back = unrotate(flat, positions, ropes.uniform).reshape(n, -1)  # = Retriever.key_features
        else:  # each key layer by its own rope
            layer_ids = self.retriever.key_layers
            parts = [unrotate(c, positions, ropes[i]) for c, i in zip(chosen, layer_ids, strict=True)]
            back = torch.stack(parts, dim=1).reshape(n, -1)
        return self.retriever.project_keys(back).to(torch.float16)

    def restore(self, chunk: Chunk, at: Place = "end", before: int | None = None) -> None:
        """Splice a saved chunk back from the store with no forward pass: at the end of the cache, at its
        logical place, or (``before`` a resident chunk's id) just in front of that chunk; in compact mode the
        chunks after it move up (their keys re-anchored)."""
        assert self.store is not None and chunk.state is ChunkState.SAVED
        try:
            saved = self.store.get(chunk.chunk_id)
        except CorruptChunkError as e:  # never served: the store dropped it, its tokens are re-prefilled
            _log.warning("%s: recomputing it from its tokens", e)
            self._reap()
            self.recompute(chunk)
            return
        self._reap()  # moving it from disk into RAM may have spilled and dropped others
        if not self._fits(saved):
            self.store.delete(chunk.chunk_id)
            self.saved.discard(chunk.chunk_id)
            self.recompute(chunk)
            return
        old = saved.meta_int64("positions")
        index, start = self._landing(chunk, at) if before is None else self._in_front(chunk, before)
        new = torch.arange(start, start + chunk.num_tokens)
        seg = self.splice(index, chunk, saved, old, new)
        self.store.delete(chunk.chunk_id)
        self.saved.discard(chunk.chunk_id)
        self.segments[chunk.chunk_id] = seg
        if self.mode == "compact":
            self.compact()

    def recompute(self, chunk: Chunk) -> None:
        """Re-prefill a discarded chunk's tokens at the end of the cache (recovery by recompute). A hybrid
        model's recurrent state has them already: it reads them without taking them in again."""
        self.append(chunk, absorb=False)

    def discard(self, chunk: Chunk) -> None:
        """Forget a chunk entirely (history truncation): free its pool blocks or its saved copy."""
        seg = self.segments.pop(chunk.chunk_id, None)
        self._opened_at.pop(chunk.chunk_id, None)
        if seg is not None:
            self.engine.evict(self.seq, seg)
        elif self.store is not None and chunk.chunk_id in self.store:
            self.store.delete(chunk.chunk_id)
        self.saved.discard(chunk.chunk_id)

    def truncate(self, chunk: Chunk, keep: int) -> None:
        """Keep the first ``keep`` tokens of a resident chunk (history truncation inside a chunk)."""
        self.engine.truncate(self.seq, self.segments[chunk.chunk_id], keep)

    def share(self, source: Pager, chunk: Chunk, num_tokens: int) -> None:
        """Make this pager's copy of a resident chunk of ``source`` resident here, at the end of the cache,
        holding its first ``num_tokens`` tokens at the same positions: the pool blocks are shared by
        reference (a forked branch), not copied or recomputed."""
        seg = self.engine.share(source.segments[chunk.chunk_id], self.seq, num_tokens)
        self.place(chunk)
        self.segments[chunk.chunk_id] = seg

    def copy_saved(self, source: Pager, chunk: Chunk) -> bool:
        """Copy a saved chunk's K/V from ``source``'s store into this pager's; when there are none to copy,
        the chunk keeps only its breadcrumb (:meth:`lost`) and False is returned."""
        self.place(chunk)
        if self.store is None or source.store is None or chunk.chunk_id not in source.store:
            return False  # discarded here: a breadcrumb
        saved = source.store.get(chunk.chunk_id)
        source._reap()
        self.saved.add(chunk.chunk_id)
        self.store.put(chunk.chunk_id, saved.k, saved.v, saved.meta)
        self._reap()
        return True

    def adopt(self, chunk: Chunk) -> None:
        """Record a chunk whose K/V are in this pager's store, not in the pool (a session restored from its
        snapshot starts swapped out: its chunk files are handed to the store)."""
        self.place(chunk)
        self.saved.add(chunk.chunk_id)

    def _reap(self) -> None:
        """Mark the chunks whose K/V the store dropped since it was last asked (:meth:`lost`) and keep
        their ids for :meth:`take_dropped`: the store reports, it never calls back."""
        if self.store is None:
            return
        for key in self.store.take_dropped():
            chunk = self.chunks.get(key) if isinstance(key, int) else None
            if chunk is not None and self.lost(chunk):
                self.dropped.append(chunk.chunk_id)

    def take_dropped(self) -> list[int]:
        """The ids of the saved chunks whose K/V were dropped since the last call (they keep their
        breadcrumb: a restore recomputes them), oldest first."""
        self._reap()
        dropped, self.dropped = self.dropped, []
        return dropped

    def lost(self, chunk: Chunk) -> bool:
        """A saved chunk whose K/V are gone (its store dropped them over its caps, or their file cannot be
        read) keeps its breadcrumb: text, tokens, digest. True when it was saved."""
        if chunk.chunk_id not in self.saved:
            return False
        self.saved.discard(chunk.chunk_id)
        return True

    def swap_out(self) -> list[tuple[int, list[int]]]:
        """Save every resident chunk (kv_restore) and free the pool; returns (chunk id, positions) in cache
        order, which :meth:`swap_in` needs to rebuild the cache exactly."""
        record = [(cid, self.segments[cid].positions.tolist()) for cid in self.order()]
        self.evict([self.chunks[cid] for cid, _ in record], as_they_are=True)
        return record

    def swap_in(self, record: list[tuple[int, list[int]]]) -> list[int]:
        """Splice swapped-out chunks back in their cache order at their positions: no forward pass, no
        rotation (keys saved elsewhere, by an eviction, are moved), the same cache as before :meth:`swap_out`
        (a chunk dropped, or whose file fails its check, is recomputed instead); returns the ids of the
        chunks recomputed."""
        assert self.store is not None
        recomputed = []
        for cid, positions in record:
            chunk = self.chunks[cid]
            pos = torch.tensor(positions, dtype=torch.int64)
            saved = self._take(chunk)
            if saved is None:
                self.append(chunk, start=positions[0], absorb=False)
                recomputed.append(cid)
                continue
            old = saved.meta_int64("positions")
            self.segments[cid] = self.splice(len(self.seq.segments), chunk, saved, old, pos)
        return recomputed

    def _take(self, chunk: Chunk) -> StoredChunk | None:
        """Pop a saved chunk's K/V from the store; None when it is not saved, or when its file fails its
        check (logged: the store drops it, so the chunk is marked discarded and never served)."""
        assert self.store is not None
        if chunk.chunk_id not in self.saved:
            return None
        self.saved.discard(chunk.chunk_id)
        try:
            saved = self.store.pop(chunk.chunk_id)
        except CorruptChunkError as e:
            _log.warning("%s: recomputing it from its tokens", e)
            self._reap()
            return None
        return saved if self._fits(saved) else None

    def _fits(self, saved: StoredChunk) -> bool:
        """Whether this pool can take a saved chunk back as it is: one saved after sliding-window layers let
        go of some of its K/V (:func:`held_from`) cannot go into a pool that keeps every layer's (a server
        restarted with ``--window-margin full``, a replica configured so): its tokens are recomputed."""
        if held_from(saved) and not self.engine.pool.slides:
            _log.warning(
                "a chunk saved without its window layers' K/V, in a pool that keeps them: recomputing it"
            )
            return False
        return True

    def release(self) -> None:
        """Free every resident chunk and forget the saved ones."""
        self.seq.release()
        self.segments.clear()
        self.saved.clear()
        self._opened_at.clear()
        if self.store is not None:
            self.store.close()

    def _in_front(self, chunk: Chunk, before: int) -> tuple[int, int]:
        """(cache index, first position) for a chunk coming back just in front of resident chunk ``before``:
        in compact mode it takes that chunk's first position (compaction then moves the rest up); in sparse
        mode its own logical positions."""
        seg = self.segments[before]
        index = self.seq.segments.index(seg)
        return index, chunk.original_start if self.mode == "sparse" else int(seg.positions[0])

    def _landing(self, chunk: Chunk, at: Place) -> tuple[int, int]:
        """(cache index, first position) for a chunk coming back: at the end, or at its logical place."""
        order = self.order()
        if at == "end":
            index = len(self.seq.segments)
            start = chunk.original_start if self.mode == "sparse" else self.seq.next_position()
            return index, start
        before = [cid for cid in order if self.chunks[cid].original_start < chunk.original_start]
        index = self.seq.segments.index(self.segments[before[-1]]) + 1 if before else 0
        if self.mode == "sparse":
            return index, chunk.original_start
        return index, sum(self.segments[cid].num_tokens for cid in before)


def held_from(saved: StoredChunk) -> int:
    """The first token of a saved chunk whose sliding-window layers' K/V it holds (0: every token's, as
    for a model without such layers; :attr:`Segment.held_from` when it was saved)."""
    return int(saved.meta.get("held_from", 0))
